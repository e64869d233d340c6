"""Bytes DeepSeek-V3.2's lightning indexer keeps for backward from its index scores, at a few sequence lengths.

One forward of ``SparseIndexer.scores`` (fp32, CPU, ``--batch`` sequences, DeepSeek-V3.2's indexer: 64 heads of 128,
64 rotated columns, hidden 7168, query latent 1536) under saved-tensor hooks that add up the distinct
storages autograd keeps (the weights and the inputs left out), and that total per query and key.

    python scripts/indexer_memory.py --batch 2 --seq 256 512 1024
"""

from __future__ import annotations

import argparse

import torch

from megacann.layers.rotary import RotaryEmbedding
from megacann.layers.sparse_indexer import SparseIndexer

HIDDEN, LATENT, HEADS, WIDTH, ROPE = 7168, 1536, 64, 128, 64


def saved_bytes(indexer: SparseIndexer, batch: int, seq: int) -> int:
    """Bytes of the distinct storages one score forward saves for backward (weights and inputs excluded)."""
    hidden = torch.randn(batch, seq, HIDDEN, requires_grad=True)
    latent = torch.randn(batch, seq, LATENT, requires_grad=True)
    tables = RotaryEmbedding(ROPE, 10000.0)(torch.arange(seq))
    leaves = {t.untyped_storage().data_ptr() for t in (*indexer.parameters(), hidden, latent)}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in leaves:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        scores = indexer.scores(hidden, latent, tables)
    del scores
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args()
    torch.manual_seed(0)
    indexer = SparseIndexer(HIDDEN, LATENT, HEADS, WIDTH, ROPE, top_k=2048)
    print(f"{'tokens':>7} {'saved MiB':>10} {'per query and key (bytes)':>26}")
    for seq in args.seq:
        saved = saved_bytes(indexer, args.batch, seq)
        print(f"{seq:>7} {saved / 2**20:>10.1f} {saved / (args.batch * seq**2):>26.1f}")


if __name__ == "__main__":
    main()
