"""DeepSeek-V4 under activation checkpointing: ``selective`` recomputes each layer's attention over its
window and compressed entries in backward, ``full`` each whole block (streams' mixing, attention and
experts), and neither changes the training trace (one process, fp32, a tiny model with every attention
kind and both routings, 24 tokens: past the window, several compressed entries). Probes: the calls of the
attention kernel and of the first layer's experts per step, once more in backward where recomputed."""

from __future__ import annotations

from dist_harness import run_on_ranks
from test_deepseek_v4 import V4

MODES = ("none", "selective", "full")
STEPS = 2


def _traces() -> dict:
    from training_helpers import SyntheticData, tiny_config

    import megacann.ops as ops
    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    attention, out = ops.scaled_dot_product_attention, {}
    for mode in MODES:
        ps.destroy_model_parallel()
        overrides = [f"model.activation_checkpointing={mode}", "optim.grad_accum_steps=1", "data.seq_length=24"]
        cfg = tiny_config(V4 + ["model.precision=fp32"] + overrides)
        trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
        calls = {"experts": 0, "attention": 0}
        # a pre-hook: torch stops a recompute as soon as the saved tensors are back, before the experts return
        trainer.model_chunks[0].layers["0"].mlp.register_forward_pre_hook(
            lambda *a, calls=calls: calls.__setitem__("experts", calls["experts"] + 1)
        )

        def counted(*args, calls=calls, **kwargs):
            calls["attention"] += 1
            return attention(*args, **kwargs)

        ops.scaled_dot_product_attention = counted
        try:
            trace = [trainer.train_step() for _ in range(STEPS)]
        finally:
            ops.scaled_dot_product_attention = attention
        out[mode] = {
            "losses": [m["loss"] for m in trace],
            "norms": [m["grad_norm"] for m in trace],
            "calls": {name: count / STEPS for name, count in calls.items()},
        }
    return out


def test_recompute_really_recomputes_and_changes_nothing():
    runs = run_on_ranks(_traces, 1, timeout=300)[0]
    once = runs["none"]["calls"]
    assert once["experts"] == 1 and once["attention"] > 4  # blocks of the window on the compressed layers
    assert runs["selective"]["calls"] == {"experts": 1, "attention": 2 * once["attention"]}
    assert runs["full"]["calls"] == {"experts": 2, "attention": 2 * once["attention"]}
    for mode in ("selective", "full"):
        assert runs[mode]["losses"] == runs["none"]["losses"], mode
        assert runs[mode]["norms"] == runs["none"]["norms"], mode
