"""The .bin/.idx format: round trip, and files from an independent writer that follows the spec byte by byte."""

import struct

import numpy as np
import pytest

from megacann.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    dtype_for_vocab,
    write_indexed_dataset,
)
from megacann.data.tokenizer import ByteTokenizer

# Megatron's .idx layout, written out independently of megacann's own code.
SPEC_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
SPEC_FORMATS = {"uint16": "H", "int32": "i", "int64": "q", "uint8": "B"}


def spec_write(prefix, sequences, dtype_name, document_indices=None):
    """Write a pair the way Megatron-LM / MindSpeed preprocessing lays it out, with `struct` only."""
    fmt, size = SPEC_FORMATS[dtype_name], struct.calcsize(SPEC_FORMATS[dtype_name])
    with open(prefix + ".bin", "wb") as f:
        for seq in sequences:
            f.write(struct.pack(f"<{len(seq)}{fmt}", *seq))
    if document_indices is None:
        document_indices = list(range(len(sequences) + 1))
    pointers, at = [], 0
    for seq in sequences:
        pointers.append(at)
        at += len(seq) * size
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", SPEC_CODES[dtype_name]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(struct.pack(f"<{len(sequences)}i", *[len(s) for s in sequences]))
        f.write(struct.pack(f"<{len(sequences)}q", *pointers))
        f.write(struct.pack(f"<{len(document_indices)}q", *document_indices))


def test_round_trip_text_to_tokens(tmp_path):
    tok = ByteTokenizer()
    texts = ["hello world", "", "naïve café ☕", "x" * 1000]
    prefix = write_indexed_dataset(str(tmp_path / "rt"), [tok.encode(t) + [tok.eos_id] for t in texts], tok.vocab_size)
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.dtype == np.uint16
    for i, text in enumerate(texts):
        assert ds[i][-1] == tok.eos_id
        assert tok.decode(ds[i][:-1].tolist()) == text
    assert ds[-1].size == 1001 and list(ds.document_indices) == [0, 1, 2, 3, 4]
    assert ds.get(3, offset=10, length=5).tolist() == [ord("x")] * 5
    assert ds.num_tokens == sum(len(t.encode()) + 1 for t in texts)


@pytest.mark.parametrize("dtype_name,vocab", [("uint16", 32000), ("int32", 128256)])
def test_writer_matches_independent_spec_writer_byte_for_byte(tmp_path, dtype_name, vocab):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, vocab, size=n).tolist() for n in (5, 0, 17, 3, 64)]
    spec_write(str(tmp_path / "spec"), seqs, dtype_name)
    assert dtype_for_vocab(vocab) == np.dtype(dtype_name)
    write_indexed_dataset(str(tmp_path / "ours"), seqs, vocab)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()


def test_reads_spec_file_with_multi_sequence_documents(tmp_path):
    """Megatron's sentence-split data: several sequences per document; int64 tokens."""
    seqs = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [2**40]]
    spec_write(str(tmp_path / "m"), seqs, "int64", document_indices=[0, 2, 4, 5])
    ds = IndexedDataset(str(tmp_path / "m.idx"))  # a file name works as well as a prefix
    assert ds.dtype == np.int64 and len(ds) == 5 and ds.num_documents == 3
    assert list(ds.document_indices) == [0, 2, 4, 5]
    assert [ds[i].tolist() for i in range(5)] == seqs
    assert list(ds.sequence_pointers) == [0, 24, 32, 48, 80]


def test_bad_files_are_clear_errors(tmp_path):
    spec_write(str(tmp_path / "ok"), [[1, 2], [3]], "uint16")
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + (tmp_path / "ok.idx").read_bytes()[8:])
    (tmp_path / "bad.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx.*magic"):
        IndexedDataset(str(tmp_path / "bad"))
    (tmp_path / "short.idx").write_bytes((tmp_path / "ok.idx").read_bytes())
    (tmp_path / "short.bin").write_bytes(b"\x01")
    with pytest.raises(IndexedDatasetError, match=r"short\.bin"):
        IndexedDataset(str(tmp_path / "short"))
    with pytest.raises(FileNotFoundError, match=r"missing\.idx"):
        IndexedDataset(str(tmp_path / "missing"))


def test_builder_rejects_ids_beyond_dtype_and_leaves_no_files(tmp_path):
    with pytest.raises(ValueError, match="int32"), IndexedDatasetBuilder(str(tmp_path / "x"), np.uint16) as b:
        b.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []


def test_pickle_reopens_instead_of_copying(tmp_path):
    import pickle

    prefix = write_indexed_dataset(str(tmp_path / "p"), [[1, 2, 3]], 100)
    blob = pickle.dumps(IndexedDataset(prefix))
    assert len(blob) < 500 and pickle.loads(blob)[0].tolist() == [1, 2, 3]
