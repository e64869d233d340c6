"""The cost of a split backward (B then W, what zero-bubble schedules run) against the fused backward, in one run.

    python benchmarks/split_backward.py [--hidden 256 --layers 4 --ffn 688 --seq 256 --batch 4 --vocab 2048
                                         --repeat 5 --recompute none|selective|full --head]

One process builds a LLaMA model chunk that takes hidden states in (a pipeline stage past the first: no
embedding; ``--head`` adds the head and loss, a last stage) twice with the same weights: plain, and
prepared for a split backward (:func:`megacann.pipeline.split_backward.prepare_split_backward`, what
``distributed.pipeline_schedule`` zb1p does: its weights' products defer their gradients). On the same
micro-batch it times:

- ``fused``: one ``torch.autograd.backward`` of the plain model (what 1F1B runs);
- ``fused, deferrable``: the same on the prepared model: what every backward would cost if the products
  were always the deferrable ones (activation checkpointing cannot stop its recompute before the last
  product of a region when that product is an autograd function);
- ``B`` / ``W`` / ``B+W``: :func:`~megacann.pipeline.split_backward.backward_input` then
  :func:`~megacann.pipeline.split_backward.backward_weight` on the prepared model: B computes the input
  gradient and leaves the weight gradients' closures for W;
- ``graph B`` / ``graph B+W``: the split done on the autograd graph of the plain model alone, as
  torchtitan's stage backward does (``torch.distributed.pipelining``'s ``stage_backward_input`` /
  ``stage_backward_weight``: B keeps the graph, W back-propagates from the products into the weights).

Forwards are not timed. Times are this process's CPU time (``time.process_time``; ``--threads`` 1 by
default), which a machine shared with other jobs distorts less than wall time. Each variant runs
``--repeat`` times in turns; the medians are printed with their ratio to ``fused``. Also checked: B+W gives
the fused gradients (max abs difference printed).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import add_int_args, add_llama_size_args, llama_model  # first: puts tests/ on sys.path
from dist_harness import run_on_ranks  # the tests' gloo launcher

VARIANTS = ("fused", "fused, deferrable", "B", "W", "B+W", "graph B", "graph W", "graph B+W")


def _graph_split(outputs, grads, x, params) -> tuple[float, float]:
    """torch.distributed.pipelining's split on the autograd graph: (B, W) CPU seconds, NaN where it fails."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    grads = [g if g is not None else o.new_ones(()) for g, o in zip(grads, outputs)]
    t0 = time.process_time()
    try:
        _, groups = stage_backward_input(outputs, grads, [x], iter(params))
        t1 = time.process_time()
        stage_backward_weight(iter(params), groups)
    except RuntimeError as error:  # a torch without it, or a graph it cannot split
        print(f"graph split failed: {str(error).splitlines()[0]}")
        return float("nan"), float("nan")
    return t1 - t0, time.process_time() - t1


def _measure(args: argparse.Namespace) -> dict:
    import torch

    from megacann.config import config_from_dict
    from megacann.models import ChunkPlacement
    from megacann.models.contract import backward_objective
    from megacann.models.spec import get_model_spec
    from megacann.ops.weight_grad import weight_grad_stats
    from megacann.pipeline.split_backward import (
        backward_input,
        backward_weight,
        prepare_split_backward,
        trainable_parameters,
    )
    from megacann.training.recipe import prepare_recipe
    from megacann.training.runtime import setup_runtime

    torch.set_num_threads(args.threads)
    cfg = config_from_dict(
        {
            "experiment": {"name": "split_backward", "output_dir": "/tmp/megacann-bench-unused"},
            "model": {
                **llama_model("fp32", args.hidden, args.layers, args.ffn, args.vocab, args.seq),
                "activation_checkpointing": args.recompute,
            },
            "data": {"seq_length": args.seq, "batch_size": args.batch},
            "optim": {"lr": 1e-3, "max_steps": 1},
            "logging": {"log_interval": 1, "ckpt_interval": 0},
        }
    )
    prepare_recipe(cfg, world_size=1)
    setup_runtime(cfg)
    spec = get_model_spec(cfg.model.type)
    placement = ChunkPlacement(tuple(range(args.layers)), pre_process=False, post_process=args.head)
    torch.manual_seed(0)
    plain = spec.build(cfg, placement)
    prepared = spec.build(cfg, placement)
    prepared.load_state_dict(plain.state_dict())
    prepare_split_backward([prepared])
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    grad_out = torch.randn(args.batch, args.seq, args.hidden, generator=g)

    def forward(model):
        for p in model.parameters():
            p.grad = None
        x = hidden.clone().requires_grad_()
        out = spec.forward_step(model, batch, x)
        if args.head:
            return x, [backward_objective(out, normalizer=float(tokens.numel()), aux_weight=0.0)], [None]
        return x, [out.hidden_states], [grad_out]

    def fused(model) -> float:
        _, outputs, gs = forward(model)
        t0 = time.process_time()
        torch.autograd.backward(outputs, gs)
        return time.process_time() - t0

    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(args.repeat + 1):  # the first round warms up
        times["fused"].append(fused(plain))
        reference = [p.grad.clone() for p in plain.parameters()]
        times["fused, deferrable"].append(fused(prepared))

        x, outputs, gs = forward(prepared)
        t0 = time.process_time()
        backward_input(outputs, gs, [x])
        t1 = time.process_time()
        backward_weight(outputs, gs, trainable_parameters(prepared))
        t2 = time.process_time()
        times["B"].append(t1 - t0)
        times["W"].append(t2 - t1)
        times["B+W"].append(t2 - t0)
        split = [p.grad.clone() for p in prepared.parameters()]

        x, outputs, gs = forward(plain)
        b, w = _graph_split(outputs, gs, x, trainable_parameters(plain))
        times["graph B"].append(b)
        times["graph W"].append(w)
        times["graph B+W"].append(b + w)
    medians = {k: statistics.median(v[1:]) for k, v in times.items()}
    closures = weight_grad_stats()["run"] // (args.repeat + 1)
    diff = max((a - b).abs().max().item() for a, b in zip(reference, split))
    return {"medians": medians, "max_abs_diff": diff, "closures": closures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_llama_size_args(parser, hidden=256, layers=4, ffn=688, vocab=2048, seq=256)
    add_int_args(parser, batch=4, repeat=5, threads=1)
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--head", action="store_true", help="the last stage: the head and loss too")
    args = parser.parse_args()
    result = run_on_ranks(_measure, 1, args=(args,), timeout=3600)[0]
    med = result["medians"]
    print(f"backward of a {args.layers}-layer LLaMA chunk (hidden {args.hidden}, seq {args.seq}, batch {args.batch},")
    print(f"recompute {args.recompute}{', head and loss' if args.head else ''}); median of {args.repeat}")
    for key in VARIANTS:
        print(f"  {key:18s} {med[key] * 1e3:9.1f} ms  {med[key] / med['fused']:5.2f}x fused")
    print(f"  B+W vs fused gradients: max abs difference {result['max_abs_diff']:.3g}")
    print(f"  weight-gradient closures W ran per backward: {result['closures']}")


if __name__ == "__main__":
    main()
