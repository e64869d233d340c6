"""Training under data / tensor / sequence parallelism equals one process; accumulation equals a big batch.
Probes on the transformer blocks show each layout's modes were really on (see ``ModeProbes``)."""

import pytest
import torch
from dist_harness import run_on_ranks

STEPS = 5
SEQ, LAYERS, ACCUM = 32, 4, 2  # tiny_config's sequence length, layers and grad_accum_steps
LAYOUTS_WORLD2 = {
    "dp2": [],
    "tp2": ["distributed.tensor_parallel_size=2"],
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "gpt_tp2_sp": ["model.type=gpt", "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
}
# One process; global batch = micro-batch x dp x grad_accum_steps, so the dp2 run (2 x 2 x 2) is matched
# by accumulating 4 micro-batches of 2 here, and so are 1 micro-batch of 8 and 8 micro-batches of 1.
REFERENCE_RUNS = {
    "base": [],
    "gpt": ["model.type=gpt"],
    "accum4": ["optim.grad_accum_steps=4"],
    "big_batch": ["data.batch_size=8", "optim.grad_accum_steps=1"],
    "small_micro": ["data.batch_size=1", "optim.grad_accum_steps=8"],
}
MATCHING_REFERENCE = {"dp2": "accum4", "tp2": "base", "tp2_sp": "base", "gpt_tp2_sp": "gpt"}
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3"]  # clipping active in every step; Adam well conditioned


class ModeProbes:
    """Evidence from hooks on every transformer block of a trainer that a layout's modes were on: the
    sequence length each block sees (``seq / tp`` under sequence parallelism), how many blocks each model
    chunk ran (virtual pipeline chunks), how many block forwards backward replayed (recompute), and how
    evaluation ran (autograd off, modules in eval mode, the schedule called forward-only). Set ``phase``
    to ``"eval"`` around ``trainer.evaluate()``; ``summary()`` is a plain dict."""

    def __init__(self, trainer) -> None:
        from megacann.layers import TransformerBlock
        from megacann.layers.random import is_recomputing

        self.phase, self._recomputing = "train", is_recomputing
        self.forwards = {p: [0] * len(trainer.model_chunks) for p in ("train", "eval")}
        self.seq_lengths = {"train": set(), "eval": set()}
        self.recomputes = self.eval_with_grad = self.eval_training_mode = 0
        self.forward_only = {"train": set(), "eval": set()}
        for index, chunk in enumerate(trainer.model_chunks):
            for block in (m for m in chunk.modules() if isinstance(m, TransformerBlock)):
                # the block's first layer: called again when a full recompute replays the block in backward
                block.input_layernorm.register_forward_pre_hook(self._hook(index, block))
        schedule = trainer.forward_backward

        def recording(*args, **kwargs):
            self.forward_only[self.phase].add(bool(kwargs.get("forward_only", False)))
            return schedule(*args, **kwargs)

        trainer.forward_backward = recording

    def _hook(self, index: int, block):
        def seen(module, args) -> None:
            if self._recomputing():
                self.recomputes += 1
                return
            self.forwards[self.phase][index] += 1
            self.seq_lengths[self.phase].add(args[0].shape[1])
            if self.phase == "eval":
                self.eval_with_grad += torch.is_grad_enabled()
                self.eval_training_mode += block.training

        return seen

    def summary(self) -> dict:
        return {
            "forwards": self.forwards,
            "seq_lengths": {k: sorted(v) for k, v in self.seq_lengths.items()},
            "recomputes": self.recomputes,
            "eval_with_grad": self.eval_with_grad,
            "eval_training_mode": self.eval_training_mode,
            "forward_only": {k: sorted(v) for k, v in self.forward_only.items()},
        }


def _setting(overrides: list[str], key: str, default):
    """The value ``overrides`` give ``key`` (the last one wins), as the type of ``default``."""
    values = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    if not values:
        return default
    return values[-1] == "true" if isinstance(default, bool) else type(default)(values[-1])


def assert_modes_on(probes: dict, overrides: list[str], steps: int, eval_iters: int = 0) -> None:
    """One rank's ``ModeProbes.summary()`` shows the modes ``overrides`` ask for (read from the overrides,
    not from the parsed config, so a setting the config dropped fails here)."""
    tp = _setting(overrides, "distributed.tensor_parallel_size", 1)
    pp = _setting(overrides, "distributed.pipeline_parallel_size", 1)
    vpp = _setting(overrides, "distributed.virtual_pipeline_size", 1)
    sp = _setting(overrides, "distributed.sequence_parallel", False) and tp > 1
    full_recompute = _setting(overrides, "model.activation_checkpointing", "none") == "full"
    accum = _setting(overrides, "optim.grad_accum_steps", ACCUM)
    blocks_per_chunk = _setting(overrides, "model.num_layers", LAYERS) // (pp * vpp)
    train, evaluation = probes["forwards"]["train"], probes["forwards"]["eval"]
    assert train == [steps * accum * blocks_per_chunk] * vpp, probes  # vpp chunks per rank, each its blocks
    assert probes["seq_lengths"]["train"] == [SEQ // tp if sp else SEQ], probes  # seq / tp under SP
    assert probes["recomputes"] == (sum(train) if full_recompute else 0), probes  # every block replayed once
    assert probes["forward_only"]["train"] == [False], probes
    if eval_iters:
        assert evaluation == [eval_iters * accum * blocks_per_chunk] * vpp, probes
        assert probes["seq_lengths"]["eval"] == probes["seq_lengths"]["train"], probes
        assert probes["forward_only"]["eval"] == [True], probes
        assert probes["eval_with_grad"] == probes["eval_training_mode"] == 0, probes
    else:
        assert sum(evaluation) == 0, probes


def _train_runs(runs: dict[str, list[str]]) -> dict:
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict, gather_full_tensor
    from megacann.layers.sharding import get_sharding, set_sharding
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    results = {}
    for name, overrides in runs.items():
        cfg = tiny_config(COMMON + overrides, world_size=dist.get_world_size())
        runtime = setup_runtime(cfg)
        data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        trainer = Trainer(cfg, runtime, data=data)
        probes = ModeProbes(trainer)
        losses, norms, grads = [], [], None
        for _ in range(STEPS):
            metrics = trainer.train_step()
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
            if grads is None:  # the first step's (clipped) gradients, all layouts starting from equal weights
                grads = {
                    n: gather_full_tensor(set_sharding(p.main_grad, get_sharding(p)))
                    for chunk in trainer.model_chunks
                    for n, p in chunk.named_parameters()
                }
        params = full_state_dict(trainer.model_chunks)
        main = dist.get_rank() == 0
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, probes.summary())
        results[name] = {
            "losses": losses,
            "norms": norms,
            "grads": grads if main else None,
            "params": params if main else None,
            "probes": every_rank,
        }
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_train_runs, 1, args=(REFERENCE_RUNS,), timeout=300)[0]


@pytest.fixture(scope="module")
def world2():
    return run_on_ranks(_train_runs, 2, args=(LAYOUTS_WORLD2,), timeout=400)[0]


def assert_close_trace(actual, expected, rel):
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= rel * abs(e), (actual, expected)


# The key bias adds q.b to every score of a query, which softmax ignores: its true gradient is exactly 0,
# so what any run holds there is rounding noise (and Adam turns noise into +-lr steps). Checked separately.
NOISE_ONLY = ("self_attn.k_proj.bias",)


def assert_params_close(actual, expected, rel):
    """Norm-wise relative error of every tensor: ||a - e|| / ||e|| <= rel."""
    assert actual.keys() == expected.keys()
    for name in expected:
        if name.endswith(NOISE_ONLY):
            continue
        err = (actual[name] - expected[name]).norm().item()
        ref = expected[name].norm().item()
        assert err <= rel * ref, f"{name}: ||diff|| {err:.3e} vs ||ref|| {ref:.3e}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS_WORLD2))
def test_two_rank_layouts_match_one_process(reference, world2, layout):
    ref = reference[MATCHING_REFERENCE[layout]]
    got = world2[layout]
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert_params_close(got["grads"], ref["grads"], 1e-5)
    assert_params_close(got["params"], ref["params"], 1e-4)  # 5 Adam steps amplify rounding differences


@pytest.mark.parametrize("layout", sorted(LAYOUTS_WORLD2))
def test_two_rank_layouts_ran_their_modes(world2, layout):
    for probes in world2[layout]["probes"]:
        assert_modes_on(probes, COMMON + LAYOUTS_WORLD2[layout], STEPS)


def test_references_ran_one_process_modes(reference):
    for name, overrides in REFERENCE_RUNS.items():
        (probes,) = reference[name]["probes"]
        assert_modes_on(probes, COMMON + overrides, STEPS)


def test_accumulation_equals_one_big_batch(reference):
    big = reference["big_batch"]
    for other in (reference["small_micro"], reference["accum4"]):
        assert_close_trace(other["losses"], big["losses"], 1e-5)
        assert_close_trace(other["norms"], big["norms"], 1e-5)
        assert_params_close(other["grads"], big["grads"], 1e-5)
        assert_params_close(other["params"], big["params"], 1e-4)


def test_key_bias_gradient_is_zero(reference):
    grads = reference["gpt"]["grads"]
    for name, grad in grads.items():
        if name.endswith(NOISE_ONLY):
            assert grad.norm() < 1e-6 * grads[name.replace("k_proj", "q_proj")].norm() + 1e-8, name


def test_clipping_was_active(reference):
    assert all(n > 0.5 for n in reference["base"]["norms"]), reference["base"]["norms"]
    assert torch.isfinite(torch.tensor(reference["base"]["losses"])).all()
