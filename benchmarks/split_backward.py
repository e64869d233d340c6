"""The cost of a split backward (B then W, what zero-bubble schedules run) against the fused backward, in one run.

    python benchmarks/split_backward.py [--hidden 256 --layers 4 --ffn 688 --seq 256 --batch 4 --vocab 2048
                                         --repeat 5 --recompute none|selective|full --head]

One process builds a LLaMA model chunk that takes hidden states in (a pipeline stage past the first: no
embedding; ``--head`` adds the head and loss, a last stage) twice: with the layers' weight gradients
deferrable (what ``distributed.pipeline_schedule`` zb1p builds) and plain. On the same micro-batch it times:

- ``fused``: one ``torch.autograd.backward`` (the plain model: what 1F1B runs);
- ``B`` / ``W`` / ``B+W``: :func:`megacann.pipeline.split_backward.backward_input` then
  :func:`~megacann.pipeline.split_backward.backward_weight` on the deferrable model: B computes the input
  gradient and leaves the weight gradients' closures for W;
- ``old B`` / ``old B+W``: the split megacann had before (B = ``autograd.grad`` on the input with the
  graph kept, W = ``autograd.backward`` into the parameters, re-running the backward down to the weights).

Forwards are not timed. Times are this process's CPU time (``time.process_time``; ``--threads`` 1 by
default), which a machine shared with other jobs distorts less than wall time. Each variant runs
``--repeat`` times in turns; the medians are printed with their ratio to ``fused``. Also checked: B+W gives the fused gradients (max abs difference printed).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import add_int_args, add_llama_size_args, llama_model  # first: puts tests/ on sys.path
from dist_harness import run_on_ranks  # the tests' gloo launcher


def _measure(args: argparse.Namespace) -> dict:
    import torch

    from megacann.config import config_from_dict
    from megacann.models import ChunkPlacement
    from megacann.models.contract import backward_objective
    from megacann.models.spec import get_model_spec
    from megacann.ops.weight_grad import weight_grad_stats
    from megacann.pipeline.split_backward import backward_input, backward_weight, trainable_parameters
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
    cfg.distributed.pipeline_schedule = "zb1p"  # layers built to defer their weight gradients
    deferring = spec.build(cfg, placement)
    deferring.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    grad_out = torch.randn(args.batch, args.seq, args.hidden, generator=g)

    def forward(model):
        x = hidden.clone().requires_grad_()
        out = spec.forward_step(model, batch, x)
        if args.head:
            return x, [backward_objective(out, normalizer=float(tokens.numel()), aux_weight=0.0)], [None]
        return x, [out.hidden_states], [grad_out]

    def clear(model):
        for p in model.parameters():
            p.grad = None

    times: dict[str, list[float]] = {k: [] for k in ("fused", "B", "W", "B+W", "old B", "old B+W")}
    grads: dict[str, list] = {}
    for _ in range(args.repeat + 1):  # the first round warms up
        clear(plain)
        x, outputs, gs = forward(plain)
        t0 = time.process_time()
        torch.autograd.backward(outputs, gs)
        t_fused = time.process_time() - t0
        grads["fused"] = [p.grad.clone() for p in plain.parameters()]

        clear(deferring)
        x, outputs, gs = forward(deferring)
        t0 = time.process_time()
        backward_input(outputs, gs, [x])
        t1 = time.process_time()
        backward_weight(outputs, gs, trainable_parameters(deferring))
        t2 = time.process_time()
        grads["split"] = [p.grad.clone() for p in deferring.parameters()]

        clear(plain)
        x, outputs, gs = forward(plain)
        t3 = time.process_time()
        torch.autograd.grad(outputs, [x], grad_outputs=gs, retain_graph=True)
        t4 = time.process_time()
        torch.autograd.backward(outputs, grad_tensors=gs, inputs=trainable_parameters(plain))
        t5 = time.process_time()
        for key, value in (
            ("fused", t_fused),
            ("B", t1 - t0),
            ("W", t2 - t1),
            ("B+W", t2 - t0),
            ("old B", t4 - t3),
            ("old B+W", t5 - t3),
        ):
            times[key].append(value)
    medians = {k: statistics.median(v[1:]) for k, v in times.items()}
    closures = weight_grad_stats()["run"] // (args.repeat + 1)
    diff = max((a - b).abs().max().item() for a, b in zip(grads["fused"], grads["split"]))
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
    for key in ("fused", "B", "W", "B+W", "old B", "old B+W"):
        print(f"  {key:8s} {med[key] * 1e3:9.1f} ms  {med[key] / med['fused']:5.2f}x fused")
    print(f"  B+W vs fused gradients: max abs difference {result['max_abs_diff']:.3g}")
    print(f"  weight-gradient closures W ran per backward: {result['closures']}")


if __name__ == "__main__":
    main()
