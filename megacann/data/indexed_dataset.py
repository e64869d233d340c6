"""Megatron-compatible indexed token data: a ``.bin`` of concatenated token ids and an ``.idx`` index.

Layout of the ``.idx`` file (little-endian, REFERENCE.md §1)::

    magic b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence_count | <Q document_count
    int32[sequence_count] lengths | int64[sequence_count] byte offsets | int64[document_count] boundaries

Files written by Megatron-LM or MindSpeed preprocessing open as they are; files written here open there.
"""

from __future__ import annotations

import os
import struct
from typing import Optional, Union

import numpy as np

from megacann.errors import MegacannError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(MegacannError, ValueError):
    """An ``.idx`` / ``.bin`` pair that does not follow the format."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks: uint16 under 65,500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def index_path(prefix: str) -> str:
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    return prefix + ".bin"


def strip_suffix(path: str) -> str:
    """``x.bin`` / ``x.idx`` / ``x`` -> ``x``: users often pass a file name where a prefix is meant."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def exists(prefix: str) -> bool:
    return os.path.isfile(index_path(prefix)) and os.path.isfile(data_path(prefix))


class IndexedDataset:
    """Read-only, memory-mapped view of a ``.bin``/``.idx`` pair.

    ``len(ds)`` is the number of sequences, ``ds[i]`` the i-th sequence as a NumPy array,
    ``ds.get(i, offset, length)`` a slice of it without reading the rest, ``ds.document_indices`` the
    document boundaries (sequence indices, starting with 0).
    """

    def __init__(self, prefix: str):
        self.prefix = strip_suffix(str(prefix))
        idx_file, bin_file = index_path(self.prefix), data_path(self.prefix)
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset: {path!r} not found (expected a .bin/.idx pair)")
        self.dtype, count, doc_count = _read_header(idx_file)
        need = HEADER_SIZE + count * (4 + 8) + doc_count * 8
        actual = os.path.getsize(idx_file)
        if actual < need:
            raise IndexedDatasetError(
                f"{idx_file}: truncated index: {actual} bytes, expected {need} for {count} sequences "
                f"and {doc_count} document boundaries"
            )
        index = np.memmap(idx_file, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = index[offset : offset + 4 * count].view("<i4")
        offset += 4 * count
        self.sequence_pointers = index[offset : offset + 8 * count].view("<i8")
        offset += 8 * count
        self.document_indices = index[offset : offset + 8 * doc_count].view("<i8")
        bin_size = os.path.getsize(bin_file)
        itemsize = self.dtype.itemsize
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if count else 0
        if bin_size < end:
            raise IndexedDatasetError(
                f"{bin_file}: {bin_size} bytes but the index {idx_file} points up to byte {end} "
                f"(files from different runs, or a truncated .bin?)"
            )
        if bin_size % itemsize:
            raise IndexedDatasetError(f"{bin_file}: size {bin_size} is not a multiple of {self.dtype} ({itemsize} B)")
        self._bin = np.memmap(bin_file, mode="r", dtype=self.dtype) if bin_size else np.empty(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"IndexedDataset indices are integers, got {type(i).__name__}")
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} out of range (dataset has {n})")
        return self.get(int(i))

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when ``length`` is None)."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return np.asarray(self._bin[start : start + length])

    def last_tokens(self, begin: int, end: int) -> np.ndarray:
        """The last token of each sequence in ``[begin, end)`` as int64 (-1 for an empty sequence)."""
        lengths = self.sequence_lengths[begin:end].astype(np.int64)
        starts = self.sequence_pointers[begin:end] // self.dtype.itemsize
        out = np.full(len(lengths), -1, dtype=np.int64)
        nonempty = lengths > 0
        out[nonempty] = self._bin[(starts + lengths - 1)[nonempty]]
        return out

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}  # reopen (memory-map) in the receiving process; never copy the data

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


def _read_header(idx_file: str) -> tuple[np.dtype, int, int]:
    with open(idx_file, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE or header[: len(MAGIC)] != MAGIC:
        raise IndexedDatasetError(
            f"{idx_file}: not a Megatron indexed dataset index (expected magic {MAGIC!r}, "
            f"found {header[: len(MAGIC)]!r})"
        )
    (version,) = struct.unpack_from("<Q", header, 9)
    if version != VERSION:
        raise IndexedDatasetError(f"{idx_file}: index version {version} is not supported (expected {VERSION})")
    (code,) = struct.unpack_from("<B", header, 17)
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{idx_file}: unknown dtype code {code} (expected one of {sorted(DTYPE_CODES)})")
    count, doc_count = struct.unpack_from("<QQ", header, 18)
    return np.dtype(DTYPE_CODES[code]), count, doc_count


class IndexedDatasetBuilder:
    """Write a ``.bin``/``.idx`` pair, streaming: tokens go to disk as documents arrive.

    Files are written under temporary names and renamed on :meth:`finalize`, so an interrupted run never
    leaves a pair that looks complete. One sequence per document (no sentence splitting).
    """

    def __init__(self, prefix: str, dtype: Union[np.dtype, type] = np.uint16):
        self.prefix = strip_suffix(str(prefix))
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise IndexedDatasetError(f"dtype {self.dtype} cannot be stored (expected one of {list(CODE_OF_DTYPE)})")
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._tmp_suffix = f".tmp{os.getpid()}"
        self._bin_file = open(data_path(self.prefix) + self._tmp_suffix, "wb")  # noqa: SIM115 (closed in finalize/abort)
        self._lengths: list[int] = []
        self._max_token = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None

    def add_document(self, tokens) -> None:
        """Append one document (a sequence of token ids)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        if self._max_token is not None and array.size and (array.max() > self._max_token or array.min() < 0):
            raise ValueError(
                f"{self.prefix}: token id {int(array.max())} does not fit the file dtype {self.dtype} "
                f"(use int32 for vocabularies of 65,500 tokens or more)"
            )
        self._bin_file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(array.size))

    def finalize(self) -> str:
        """Write the index, move both files into place and return the prefix."""
        self._bin_file.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise IndexedDatasetError(f"{self.prefix}: a document of {lengths.max()} tokens exceeds int32 lengths")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        tmp_idx = index_path(self.prefix) + self._tmp_suffix
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(documents)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
        os.replace(data_path(self.prefix) + self._tmp_suffix, data_path(self.prefix))
        os.replace(tmp_idx, index_path(self.prefix))
        return self.prefix

    def abort(self) -> None:
        """Close and remove the temporary files (after an error)."""
        self._bin_file.close()
        for path in (data_path(self.prefix), index_path(self.prefix)):
            if os.path.exists(path + self._tmp_suffix):
                os.remove(path + self._tmp_suffix)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(prefix: str, documents, vocab_size: int) -> str:
    """Write an iterable of token-id sequences as a pair, in the dtype Megatron picks for ``vocab_size``."""
    with IndexedDatasetBuilder(prefix, dtype_for_vocab(vocab_size)) as builder:
        for doc in documents:
            builder.add_document(doc)
    return strip_suffix(prefix)
