"""One weight update of a serving engine from a live model: streamed buckets against a Hugging Face directory.

The model is megacann's LLaMA at the 1.1B TinyLlama shape in bf16 (one process, CPU); the engine is a
transformers ``LlamaForCausalLM`` of the same shape, standing in for a serving engine's model. Each way
runs in a fresh process and reports its wall time and the peak extra resident memory during the update
(sampled every 5 ms from /proc, above the memory held before it):

- ``stream``: :func:`megacann.interop.stream_hf_weights` buckets of ``--bucket-mb`` MiB, each handed to
  :func:`megacann.interop.load_into_module` on the engine;
- ``to_hf_reload``: the live model written as a Hugging Face directory (``save_pretrained_hf``, what
  ``megacann-convert to-hf`` writes) and read back into the engine (safetensors ``load_file`` +
  ``load_state_dict``), as an engine that reloads from disk does.

    python benchmarks/stream_weights.py [--layers 22] [--bucket-mb 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

SHAPE = {"hidden": 2048, "ffn": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The largest resident set size seen while the block runs, sampled on a thread."""

    def __enter__(self):
        self.peak, self.running = _rss(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _rss())


def _models(layers: int):
    import torch
    import transformers
    from safetensors.torch import save_file  # noqa: F401  (the reload path's dependency, imported up front)

    from megacann.config import MegacannConfig, ModelConfig
    from megacann.models import get_model_spec
    from megacann.training.rank_model import build_rank_chunks

    model = ModelConfig(
        type="llama",
        precision="bf16",
        hidden_size=SHAPE["hidden"],
        num_layers=layers,
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        ffn_hidden_size=SHAPE["ffn"],
        vocab_size=SHAPE["vocab"],
        max_position_embeddings=2048,
    )
    cfg = MegacannConfig(model=model)
    spec = get_model_spec("llama")
    spec.fill_defaults(cfg.model)
    chunks = build_rank_chunks(cfg, spec, "cpu")
    hf_config = transformers.LlamaConfig(
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=layers,
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        vocab_size=SHAPE["vocab"],
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        engine = transformers.LlamaForCausalLM(hf_config)
    engine = engine.to_empty(device="cpu").to(torch.bfloat16)
    return cfg, chunks, engine


def run_one(way: str, layers: int, bucket_mb: float, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from megacann.interop import load_into_module, save_pretrained_hf, stream_hf_weights

    cfg, chunks, engine = _models(layers)
    before = _rss()
    start = time.perf_counter()
    buckets = 0
    with PeakRSS() as peak:
        if way == "stream":
            for bucket in stream_hf_weights(chunks, cfg.model, bucket_mb=bucket_mb):
                load_into_module(engine, bucket)
                buckets += 1
        else:
            from safetensors.torch import load_file

            with tempfile.TemporaryDirectory() as tmp:
                save_pretrained_hf(chunks, tmp, cfg.model)
                engine.load_state_dict(load_file(os.path.join(tmp, "model.safetensors")), strict=True)
    seconds = time.perf_counter() - start
    sample = engine.model.layers[0].mlp.down_proj.weight
    source = chunks[0].layers["0"].mlp.down_proj.weight
    assert torch.equal(sample, source), "the engine does not hold the model's weights after the update"
    model_bytes = sum(p.nbytes for p in chunks[0].parameters())
    return {
        "way": way,
        "seconds": seconds,
        "extra_gib": (peak.peak - before) / 2**30,
        "buckets": buckets,
        "model_gib": model_bytes / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", choices=["stream", "to_hf_reload"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.layers, args.bucket_mb, args.threads)))
        return
    rows = []
    for way in ("stream", "to_hf_reload"):
        command = [sys.executable, __file__, "--one", way, "--layers", str(args.layers)]
        command += ["--bucket-mb", str(args.bucket_mb), "--threads", str(args.threads)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"llama d{SHAPE['hidden']} x {args.layers} layers, bf16 ({rows[0]['model_gib']:.2f} GiB), "
        f"{args.threads} threads, bucket {args.bucket_mb:g} MiB"
    )
    print("| way | seconds | peak extra memory (GiB) | buckets |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['way']} | {row['seconds']:.2f} | {row['extra_gib']:.2f} | {row['buckets'] or '-'} |")
    print(f"stream / to_hf_reload time: {rows[0]['seconds'] / rows[1]['seconds']:.2f}")


if __name__ == "__main__":
    main()
