"""The optimizer update of a bf16 model with fp32 masters: per-parameter tensors vs one flat buffer.

``per-param`` is megacann's :class:`~megacann.optimizer.MixedPrecisionOptimizer` step as it is: the fused
``torch.optim.AdamW`` over one fp32 master tensor per parameter (gradients are views of the flat fp32
gradient buffer), clipping by the global norm, then ``_foreach_copy_`` of the masters into the bf16
parameters. ``flat`` is the same update over flat buffers: the same global norm and clip, AdamW through
``megacann.ops.adamw_step_`` on one flat master / moment buffer (decoupled weight decay applied to the
decayed ranges first, so one call serves both groups), one copy of the flat master into a flat bf16
buffer. Both do the same arithmetic per element; the question is what per-tensor overhead costs.

    python benchmarks/optimizer_step.py [--preset cpu|125M|1.1B] [--device cpu|cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_vs_transformers import PRESETS, megacann_trainer, synchronize  # noqa: E402

from megacann import ops  # noqa: E402
from megacann.optimizer.clip_grads import clip_grads_, global_grad_norm  # noqa: E402


class FlatAdamW:
    """AdamW over flat copies of the masters and moments of ``optimizer`` (a MixedPrecisionOptimizer)."""

    def __init__(self, optimizer, cfg):
        self.params = optimizer.model_params
        self.grad = optimizer.grad_buffers.buffers[0].data
        layout = optimizer.grad_buffers.buffers[0].ranges
        self.master = torch.zeros_like(self.grad)
        self.model_flat = torch.zeros(self.grad.numel(), dtype=self.params[0].dtype, device=self.grad.device)
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.grad), torch.zeros_like(self.grad)
        self.decayed = []
        for p, m in zip(self.params, optimizer.master_params):
            start, end = layout[id(p)]
            self.master[start:end].copy_(m.detach().view(-1))
            if p.dim() >= 2:
                self.decayed.append(self.master[start:end])
        self.o, self.step_count = cfg.optim, 0

    @torch.no_grad()
    def step(self, lr: float, clip: float) -> None:
        norm = global_grad_norm(self.params)
        clip_grads_([self.grad], clip, norm)
        self.step_count += 1
        torch._foreach_mul_(self.decayed, 1 - lr * self.o.weight_decay)
        ops.adamw_step_(
            self.master,
            self.grad,
            self.exp_avg,
            self.exp_avg_sq,
            lr=lr,
            beta1=self.o.adam_beta1,
            beta2=self.o.adam_beta2,
            eps=self.o.adam_eps,
            weight_decay=0.0,
            step=self.step_count,
        )
        self.model_flat.copy_(self.master)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    shape = argparse.Namespace(**{**PRESETS[args.preset], "device": args.device})
    trainer = megacann_trainer(shape, "bf16")
    trainer.train_step()  # real gradients in the buffer, optimizer state created
    optimizer = trainer.optimizer
    flat = FlatAdamW(optimizer, trainer.cfg)
    numel = flat.grad.numel()
    grads_saved = flat.grad.clone()

    def per_param():
        optimizer.step()

    def flat_step():
        flat.step(1e-4, trainer.cfg.optim.clip_grad)

    times = {"per-param": [], "flat": []}
    for _ in range(args.rounds):
        for name, fn in (("per-param", per_param), ("flat", flat_step)):
            for _ in range(args.repeats):
                flat.grad.copy_(grads_saved)  # every update starts from the same (unclipped) gradients
                synchronize(args.device)
                start = time.perf_counter()
                fn()
                synchronize(args.device)
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{args.preset}: {numel / 1e6:.1f}M parameters in {len(flat.params)} tensors, {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    for name, t in med.items():
        print(f"  {name:9s} {t * 1e3:8.2f} ms per update ({numel * 28 / t / 1e9:.1f} GB/s of AdamW traffic)")
    print(f"  flat / per-param time: {med['flat'] / med['per-param']:.3f}")


if __name__ == "__main__":
    main()
