"""One ``.safetensors`` file read tensor by tensor with plain reads, no memory map.

A memory-mapped file keeps every page a load touched resident in the process until the map closes, so
loading a whole model that way holds the weights twice (the model's copy and the file's pages). Reading
each tensor into its own buffer holds only the tensors being converted; the file's pages stay in the
page cache, which the kernel may drop. The format: an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, data offsets relative to the end of the header), then the tensors' bytes.
"""

from __future__ import annotations

import json
import struct

import torch

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_READ = 1 << 30  # bytes per read call (Linux reads at most ~2 GiB at once)


class SafetensorsFile:
    """The tensors of one safetensors file by name (:meth:`keys`, :meth:`get_tensor`)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.path, self.entries, self.data_start = path, header, 8 + length

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which megacann cannot read")
        start, stop = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=dtype)
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if len(data) != stop - start:
            raise ValueError(f"{self.path}: tensor {name!r} holds {stop - start} bytes, its shape needs {len(data)}")
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + start)
            done = 0
            while done < len(data):
                read = f.readinto(data[done : done + _MAX_READ])
                if not read:
                    raise ValueError(f"{self.path}: the file ends inside tensor {name!r}")
                done += read
        return tensor
