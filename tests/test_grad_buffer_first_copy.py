"""The gradient buffer copies a parameter's first gradient of a step into its slot instead of zeroing the
whole buffer and adding (0 + g == g): its gradients equal plain autograd's bit for bit, slots that received
nothing reduce as zeros, no fill runs over the buffer (only the slots nothing wrote are zeroed), and every
mode the buffer serves trains as one process does (which test_training_reference.py checks against plain
PyTorch)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from test_training_parity import NOISE_ONLY
from torch.utils._python_dispatch import TorchDispatchMode

from megacann.optimizer.grad_buffer import GradBuffers
from megacann.optimizer.zero.grad_buffer import ShardedGradBuffer

MICRO_BATCHES = 3


def _model(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).to(dtype)


def _loss(model: torch.nn.Sequential, step: int, micro: int, skip_last: bool) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro)).to(dtype)
    for layer in model[:-1] if skip_last else model:
        x = torch.tanh(layer(x))
    return x.float().square().sum()


def _buffers(model: torch.nn.Sequential, kind: str) -> GradBuffers:
    params = list(model.parameters())
    if kind == "plain":
        return GradBuffers(params, bucket_size=100)
    if kind == "overlap":
        return GradBuffers(params, bucket_size=100, overlap=True)
    return GradBuffers(params, 100, pad_for_zero=True, overlap=True, buffer_cls=ShardedGradBuffer, keep_full=False)


def _reference(model: torch.nn.Sequential, step: int, skip_last: bool) -> list[torch.Tensor]:
    """Plain autograd's sum over the micro-batches, in fp32 (torch's own accumulation: first, then +=)."""
    params = list(model.parameters())
    sums: list = [None] * len(params)
    for micro in range(MICRO_BATCHES):
        grads = torch.autograd.grad(_loss(model, step, micro, skip_last), params, allow_unused=True)
        for i, g in enumerate(grads):
            if g is not None:
                sums[i] = g.float().clone() if sums[i] is None else sums[i].add_(g.float())
    return [torch.zeros(p.shape) if s is None else s for p, s in zip(params, sums)]


def _step(model, buffers: GradBuffers, step: int, skip_last: bool) -> None:
    buffers.zero()
    for micro in range(MICRO_BATCHES):
        with buffers.last_micro_batch_backward(micro == MICRO_BATCHES - 1):
            _loss(model, step, micro, skip_last).backward()
    buffers.finish_grad_sync()


@pytest.mark.parametrize("kind", ["plain", "overlap", "zero2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_plain_autograd_and_unused_slots_are_zeros(kind, dtype):
    """Step 1 uses every layer, step 2 not the last one: its slot (holding step 1's sums) reads as zeros."""
    model = _model(dtype)
    buffers = _buffers(model, kind)
    last = set(map(id, model[-1].parameters()))
    for step, skip_last in ((1, False), (2, True)):
        _step(model, buffers, step, skip_last)
        for p, ref in zip(model.parameters(), _reference(model, step, skip_last)):
            got = buffers.reduced_grad(p).view(p.shape)
            assert torch.equal(got, ref), (kind, dtype, step, tuple(p.shape))
            if skip_last and id(p) in last:
                assert not got.any()
            if kind != "zero2" and dtype == torch.float32:  # the optimizer's .grad is the slot again
                assert p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr()
    buffers.remove_hooks()


def test_update_grads_without_finish_reads_unwritten_slots_as_zeros():
    """One rank, a loop that steps without finish_grad_sync: the buffer it updates with is still exact."""
    model = _model(torch.float32)
    buffers = _buffers(model, "plain")
    for step, skip_last in ((1, False), (2, True)):
        buffers.zero()
        _loss(model, step, 0, skip_last).backward()
        buffers.update_grads()
        for p, ref in zip(model.parameters(), _reference_one(model, step, skip_last)):
            assert torch.equal(p.main_grad, ref) and p.grad.data_ptr() == p.main_grad.data_ptr()
    assert not model[-1].weight.main_grad.any()  # step 1's gradient was there
    buffers.remove_hooks()


def _reference_one(model, step: int, skip_last: bool) -> list[torch.Tensor]:
    params = list(model.parameters())
    grads = torch.autograd.grad(_loss(model, step, 0, skip_last), params, allow_unused=True)
    return [torch.zeros(p.shape) if g is None else g for p, g in zip(params, grads)]


class _BufferWrites(TorchDispatchMode):
    """Every fill/zero/copy/add op writing into ``storage``, with the elements it wrote."""

    def __init__(self, storage: torch.Tensor):
        super().__init__()
        self.ptr, self.ops = storage.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and target.untyped_storage().data_ptr() == self.ptr:
            self.ops.append((func.__name__.split(".")[0], target.numel()))
        return out


@pytest.mark.parametrize("skip_last", [False, True])
def test_no_fill_over_the_buffer(skip_last):
    """A step writes the buffer with one copy per parameter that got a gradient (its first micro-batch) and
    in-place adds; it zeroes only the slots nothing wrote (the skipped last layer's, which also proves the
    probe sees a zeroing)."""
    model = _model(torch.float32)
    buffers = _buffers(model, "plain")
    (buffer,) = buffers.buffers
    _step(model, buffers, 0, False)
    probe = _BufferWrites(buffer.data)
    with probe:
        _step(model, buffers, 1, skip_last)
    buffers.remove_hooks()
    unused = list(model[-1].parameters()) if skip_last else []
    used = [p for p in model.parameters() if all(p is not q for q in unused)]
    fills = [n for op, n in probe.ops if op in ("fill_", "zero_")]
    copies = [n for op, n in probe.ops if op == "copy_"]
    adds = [op for op, _ in probe.ops if op == "add_"]
    assert sorted(fills) == sorted(p.numel() for p in unused)
    assert sorted(copies) == sorted(p.numel() for p in used)
    assert len(adds) == (MICRO_BATCHES - 1) * len(used)


# -- training: every mode the buffer serves trains as one process does --------------------------------

LR = 1e-3  # the learning rate the project's other parity tests train at
CONTROL_LR = 1.1 * LR  # the control: one process at an update 10 % off, which every bound must see
COMMON = [
    f"optim.lr={LR}",
    "optim.clip_grad=0.5",
    "optim.grad_accum_steps=3",
    "data.batch_size=1",
    "data.seq_length=16",
]
SMALL = ["distributed.bucket_size_mb=0.02"]
OVERLAP = ["distributed.overlap_grad_reduce=true"]
Z2 = ["distributed.zero_optimization=2"]
STEPS = 3


def _train(overrides: list[str], steps: int = STEPS, distinct: int | None = None) -> dict:
    """``steps`` steps of the tiny model (on ``distinct`` samples over and over, if given); the loss,
    gradient norm and whole weights after every step."""
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict
    from megacann.ops.weight_grad import weight_grad_stats
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    w_runs = weight_grad_stats()["run"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = tiny_config(COMMON + overrides, world_size=world)
    runtime = setup_runtime(cfg)
    data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), distinct)
    trainer = Trainer(cfg, runtime, data=data)
    owner = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0  # one per stage
    metrics, params = [], []
    for _ in range(steps):
        metrics.append(trainer.train_step())
        trainer.optimizer.finish_param_sync()  # ZeRO-3 with prefetch: the gathers of the update, waited for
        whole = full_state_dict(trainer.model_chunks)  # on every rank: tensor-parallel shards are gathered
        params.append(whole if owner else {})
    record = {
        "losses": [m["loss"] for m in metrics],
        "norms": [m["grad_norm"] for m in metrics],
        "params": params,
        "dp": ps.get_data_parallel_world_size(),
        "overlapped": sum(b.overlapped_buckets for b in trainer.optimizer.grad_buffers.buffers),
        "buckets": sum(len(b.buckets) for b in trainer.optimizer.grad_buffers.buffers),
        "w_runs": weight_grad_stats()["run"] - w_runs,  # deferred weight gradients computed in W
    }
    ps.destroy_model_parallel()
    return record


def _runs(runs: dict[str, list[str]]) -> dict:
    return {name: _train(overrides, *SCHEDULE.get(name, (STEPS,))) for name, overrides in runs.items()}


def _one_process(name: str, dp: int, lr: float = LR) -> dict:
    """Run ``name`` in one fresh process: its model and optimizer keys, none of its parallel layout, the
    same global batch (``dp`` times the micro-batches of one sample each) and steps, at learning rate ``lr``.
    Not in the test's own process: after the extended tier's earlier tests had run there, its offload_fp16
    reference moved by 1e-4 (norms) and failed the 1e-5 bound, while a fresh process holds 9e-8."""
    own = tuple(o for o in OVERRIDES[name] if not o.startswith("distributed."))
    own += (f"optim.grad_accum_steps={3 * dp}", f"optim.lr={lr}")
    key = (own, SCHEDULE.get(name))
    if key not in _ONE_PROCESS:  # runs that differ only in layout share it
        args = (list(own), *SCHEDULE.get(name, (STEPS,)))
        _ONE_PROCESS[key] = run_on_ranks(_train, 1, args=args, timeout=300)[0]
    return _ONE_PROCESS[key]


_ONE_PROCESS: dict[tuple, dict] = {}


def _relative(actual: list[float], expected: list[float]) -> float:
    assert len(actual) == len(expected), (actual, expected)
    return max((abs(a - e) / abs(e) for a, e in zip(actual, expected)), default=0.0)


def _weights_relative(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The whole model's norm-wise relative difference, ||a - e|| / ||e|| over every tensor together (the
    key bias, whose true gradient is 0, aside: see NOISE_ONLY). Over the whole model rather than per tensor:
    Adam turns a gradient element that cancels to ~eps into an update of up to lr, so an element of a
    small tensor holding a few such elements moves by a share of lr with the reduction order's round-off
    (LoRA's B in tp2_lora_zero2: 2.4e-5 of one such tensor at step 1, 3.8e-8 of the model)."""
    assert actual.keys() == expected.keys()
    names = [name for name in expected if not name.endswith(NOISE_ONLY)]
    diff = torch.cat([(actual[n].float() - expected[n].float()).flatten() for n in names])
    return (diff.norm() / torch.cat([expected[n].float().flatten() for n in names]).norm()).item()


def differences(ranks: list[dict], name: str, ref: dict) -> dict[str, float]:
    """Rank 0's losses and gradient norms, and every stage's weights after each step, against ``ref`` (a run
    in one process): the largest relative difference of each kind (see BOUNDS)."""
    got = ranks[0][name]
    steps = SCHEDULE.get(name, (STEPS,))[0]
    assert len(got["losses"]) == len(ref["losses"]) == steps, name
    assert [n is None for n in got["norms"]] == [n is None for n in ref["norms"]], (name, got["norms"])
    norms, ref_norms = [n for n in got["norms"] if n is not None], [n for n in ref["norms"] if n is not None]
    weights = 0.0
    for step in range(steps):
        params = {k: v for rank in ranks for k, v in rank[name]["params"][step].items()}
        if "lm_head.weight" in params.keys() - ref["params"][step].keys():  # tied: the last stage's copy
            assert torch.equal(params.pop("lm_head.weight"), params["embed_tokens.weight"]), name
        weights = max(weights, _weights_relative(params, ref["params"][step]))
    return {
        "losses": _relative(got["losses"], ref["losses"]),
        "first norm": _relative(norms[:1], ref_norms[:1]),
        "norms": _relative(norms, ref_norms),
        "weights": weights,
    }


def assert_as_one_process(ranks: list[dict], name: str) -> dict:
    """Every bound of the mode's precision holds against one process at the same learning rate, and each
    is broken by one process at CONTROL_LR (so none is too loose to see an update 10 % off); returns the
    reference run."""
    bounds = BOUNDS[_precision(name)]
    ref = _one_process(name, ranks[0][name]["dp"])
    found = differences(ranks, name, ref)
    control = differences(ranks, name, _one_process(name, ranks[0][name]["dp"], CONTROL_LR))
    print(f"{name}: largest relative differences {found}; the control's {control}")
    assert all(found[kind] <= bound for kind, bound in bounds.items()), (name, found, bounds)
    missed = [kind for kind, bound in bounds.items() if kind != "first norm" and control[kind] <= bound]
    assert not missed, f"{name}: the control at lr {CONTROL_LR} stays within the {missed} bounds: {control}"
    return ref


OVERRIDES = {
    "dp2_overlap": SMALL + OVERLAP,
    "zero2_overlap": Z2 + SMALL + OVERLAP,
    "zero1_bf16": ["distributed.zero_optimization=1", "model.precision=bf16"] + SMALL,
    "zero3_prefetch": ["distributed.zero_optimization=3", "distributed.overlap_param_gather=true"] + SMALL + OVERLAP,
    "pp2_tied_zb1p_zero2": [
        "distributed.pipeline_parallel_size=2",
        "model.tie_word_embeddings=true",
        "distributed.pipeline_schedule=zb1p",
    ]
    + Z2
    + SMALL
    + OVERLAP,
    "tp2_lora_zero2": ["distributed.tensor_parallel_size=2", "lora=true", "lora_rank=4", "lora_alpha=8.0"] + Z2,
    "offload_fp16": ["optim.offload_optimizer=true", "model.precision=fp16", "optim.initial_loss_scale=1e6"],
}
WORLD2 = ("dp2_overlap", "zero2_overlap")
EXTENDED_WORLD4 = ("zero1_bf16", "zero3_prefetch", "pp2_tied_zb1p_zero2", "tp2_lora_zero2", "offload_fp16")
BF16_UNIT_ROUNDOFF = 2.0**-8
# Relative bounds against one process, by precision, at every step (the largest difference over the steps).
# - fp32 / fp16: 1e-5 on losses, gradient norms and weights, as the project's other fp32 parity tests; the
#   only differences are the order of the data-parallel sums (and fp16 weights rounded from fp32 masters).
#   Measured (lr 1e-3, every fp32 and fp16 mode): losses <= 1.8e-7, norms <= 1.2e-7, weights <= 1.1e-6.
# - bf16, as tests/test_bf16_parity.py: every loss within 2u, the first step's norm (equal weights) within 4u,
#   later norms not bounded (a bf16 weight an ulp apart moves a tiny model's next norm by a few percent);
#   weights within u: the fp32 masters agree, so a bf16 weight differs only where its master sits at a
#   rounding boundary, by one spacing (at most 2u of itself), and u holds while under a quarter of them do.
#   Measured over 12 steps: losses 7.0e-5, first norm 1.2e-7, weights 3.3e-4.
# The control (one process at CONTROL_LR) must break every bound but the first norm (equal weights at step 1):
# measured fp32 losses 7.4e-5 - 6.7e-4, norms 6.5e-4 - 5.1e-3, weights 5.1e-4 - 3.3e-3; fp16 losses 2.4e-5;
# bf16 losses 1.0e-2, weights 6.1e-3. With 3 steps bf16's 2u loss bound does not see an update 10 % off (the
# loss moves 6e-3 by step 3), so its mode trains 12 steps on 12 samples memorised, as test_bf16_parity does.
BOUNDS = {
    "fp32": {"losses": 1e-5, "first norm": 1e-5, "norms": 1e-5, "weights": 1e-5},
    "fp16": {"losses": 1e-5, "first norm": 1e-5, "norms": 1e-5, "weights": 1e-5},
    "bf16": {"losses": 2 * BF16_UNIT_ROUNDOFF, "first norm": 4 * BF16_UNIT_ROUNDOFF, "weights": BF16_UNIT_ROUNDOFF},
}
# (steps, distinct samples): runs longer than STEPS. zero1_bf16 on memorised data (above); offload_fp16
# skips an overflowing step, and with the block-wise initial draw its 2 updates in 3 steps moved the control's
# loss only 4.9e-6 (under the 1e-5 bound the control must break): 5 steps give it 4 updates
SCHEDULE = {"zero1_bf16": (12, 12), "offload_fp16": (5,)}


def _precision(name: str) -> str:
    return next((o.split("=")[1] for o in OVERRIDES[name] if o.startswith("model.precision=")), "fp32")


def test_dp2_overlap_and_zero2_train_as_one_process():
    ranks = run_on_ranks(_runs, 2, args=({name: OVERRIDES[name] for name in WORLD2},))
    for name in WORLD2:
        for rank in ranks:
            assert rank[name]["overlapped"] == rank[name]["buckets"] > 2, name  # reductions started in backward
        assert_as_one_process(ranks, name)


@pytest.mark.extended
def test_world4_modes_train_as_one_process():
    ranks = run_on_ranks(_runs, 4, args=({name: OVERRIDES[name] for name in EXTENDED_WORLD4},), timeout=600)
    for name in EXTENDED_WORLD4:
        ref = assert_as_one_process(ranks, name)
        if name == "offload_fp16":  # fp16 overflowed and skipped a step, as in one process
            assert None in ref["norms"]
    assert sum(rank["pp2_tied_zb1p_zero2"]["w_runs"] for rank in ranks) > 0  # the last stage split its backward
