"""Shared pieces of the ZeRO-3 tests (run inside the spawned ranks): the recipe overrides, one training
run with the evidence that weights really are sharded, and the layout-free checkpoint round trip."""

from __future__ import annotations

STEPS = 4
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", "data.seq_length=16"]  # clipping active in every step
Z3 = ["distributed.zero_optimization=3"]
PREFETCH = ["distributed.overlap_grad_reduce=true", "distributed.overlap_param_gather=true"]
SMALL_BUCKETS = ["distributed.bucket_size_mb=0.02"]  # ~5k elements: blocks split into several buckets
TP2_SP = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
PP2 = ["distributed.pipeline_parallel_size=2", "model.tie_word_embeddings=true"]
CP2 = ["distributed.context_parallel_size=2"]
HYBRID2 = ["distributed.zero_shard_group_size=2"]
LORA = ["lora=true", "lora_rank=4", "lora_alpha=8.0", "lora_target_modules=all-linear"]
RECOMPUTE = ["model.activation_checkpointing=full"]


def accum(dp: int) -> list[str]:
    """The accumulation that keeps the global batch at 16 samples (micro-batch 2) on ``dp`` ranks."""
    return [f"optim.grad_accum_steps={8 // dp}"]


class GatherProbe:
    """Before every block runs (its own gather done): how many weight elements are whole on this rank.
    Registered after the optimizer, so its pre-hooks run after ZeRO-3's. ``block_types``: the classes
    probed (default: megacann's transformer block)."""

    def __init__(self, trainer, block_types: tuple = ()):
        from megacann.layers.transformer import TransformerBlock

        self.optimizer = trainer.optimizer
        self.peak = 0
        for chunk in trainer.model_chunks:
            for module in chunk.modules():
                if isinstance(module, block_types or (TransformerBlock,)):
                    module.register_forward_pre_hook(self._probe)

    def gathered(self) -> int:
        return sum(s.gathered_numel() for s in storages(self.optimizer))

    def _probe(self, module, args) -> None:
        self.peak = max(self.peak, self.gathered())


def storages(optimizer) -> list:
    from megacann.optimizer.zero.sharded_params import ShardedParams

    mine = [s.params for s in getattr(optimizer, "shards", []) if isinstance(s.params, ShardedParams)]
    return mine + list(getattr(optimizer, "frozen", []))


def memory_facts(trainer) -> dict:
    """Bytes the optimizer holds (read from the tensors) and what the formula needs, between two steps."""
    from megacann.optimizer.memory import optimizer_memory

    optimizer = trainer.optimizer
    chunks = trainer.model_chunks
    return {
        "memory": optimizer_memory(optimizer),
        "buffers": [(b.numel, b.group_size, sum(p.numel() for p in b.params)) for b in optimizer.grad_buffers.buffers],
        "frozen_numel": [(s.layout.numel, s.size, s.shard.numel()) for s in getattr(optimizer, "frozen", [])],
        "whole_numel": sum(p.numel() for c in chunks for p in c.parameters()),
        "stored_bytes": sum(p.untyped_storage().nbytes() for c in chunks for p in c.parameters()),
        "gathered": sum(s.gathered_numel() for s in storages(optimizer)),
        # elements (padding included) of each unit: the chunk's own weights first, then its blocks
        "unit_numels": [
            sum(storage.layout.buckets[index].numel for storage, index in unit.pieces)
            for unit in (optimizer._unit_hooks.units if getattr(optimizer, "_unit_hooks", None) else [])
        ],
    }


def _with_validation():
    from training_helpers import SyntheticData

    class WithValidation(SyntheticData):
        def valid(self):
            return self._iterate(1000)

    return WithValidation


def train_run(overrides: list[str], steps: int = STEPS, resume_dir: str = "") -> dict:
    """Train ``steps`` steps; returns losses, norms, whole weights (on a rank per stage), the memory facts
    and, with ``resume_dir``, whether a save / load / next step equals the uninterrupted step bit for bit."""
    import torch.distributed as dist
    from test_zero_parity import _resume_is_bitwise
    from training_helpers import tiny_config

    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    WithValidation = _with_validation()
    cfg = tiny_config(COMMON + overrides, world_size=dist.get_world_size())
    runtime = setup_runtime(cfg)
    data = WithValidation(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    trainer = Trainer(cfg, runtime, data=data)
    probe = GatherProbe(trainer)
    record = {"losses": [], "norms": []}
    for _ in range(steps):
        metrics = trainer.train_step()
        record["losses"].append(metrics["loss"])
        record["norms"].append(metrics["grad_norm"])
    trainer.cfg.logging.eval_iters = 1
    record["eval"] = trainer.evaluate()  # forwards under no_grad: each unit gathered and freed again
    record.update(memory_facts(trainer))
    record["peak_gathered"] = probe.peak
    trainer.optimizer.finish_param_sync()
    params = full_state_dict(trainer.model_chunks)
    owner = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    record["params"] = params if owner else None
    if resume_dir:
        record["resume_bitwise"] = _resume_is_bitwise(trainer, resume_dir)
    ps.destroy_model_parallel()
    return record


def train_runs(runs: dict[str, list[str]], resumed: tuple[str, ...] = (), ckpt_root: str = "") -> dict:
    import os

    return {
        name: train_run(overrides, resume_dir=os.path.join(ckpt_root, name) if name in resumed else "")
        for name, overrides in runs.items()
    }


def _trainer_at(overrides: list[str], start_step: int, output_dir: str):
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cfg = tiny_config(COMMON + overrides + [f"experiment.output_dir={output_dir}"], world_size=dist.get_world_size())
    runtime = setup_runtime(cfg)
    data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    data.train = data._iterate(start_step)
    trainer = Trainer(cfg, runtime, data=data)
    trainer.state.step = start_step
    return trainer


def checkpoint_round_trip(source: list[str], target: list[str], output_dir: str) -> dict:
    """``source`` trains 2 steps, saves a checkpoint (Trainer.save_checkpoint) and trains 2 more; a fresh
    ``target`` trainer (another layout and ZeRO stage) loads it and trains the same 2 steps."""
    from megacann import parallel_state as ps

    trainer = _trainer_at(source, 0, output_dir)
    for _ in range(2):
        trainer.train_step()
    path = trainer.save_checkpoint()
    result = {"source": [trainer.train_step()["loss"] for _ in range(2)]}
    ps.destroy_model_parallel()
    trainer = _trainer_at(target, 2, output_dir)
    trainer.load_checkpoint(path)
    result["step_loaded"] = trainer.state.step
    result["target"] = [trainer.train_step()["loss"] for _ in range(2)]
    ps.destroy_model_parallel()
    return result


def round_trips(pairs: dict[str, tuple[list[str], list[str]]], root: str) -> dict:
    import os

    return {name: checkpoint_round_trip(src, dst, os.path.join(root, name)) for name, (src, dst) in pairs.items()}


def expected_bytes(facts: dict, param_bytes: int) -> dict:
    """The ZeRO-3 formula per rank: weights, gradients and Adam's moments are each 1/N of the padded buffer
    (numel / N elements); fp32 weights are their own masters; frozen weights only their shard."""
    shard = sum(numel // n for numel, n, _ in facts["buffers"])
    frozen = sum(numel // n for numel, n, _ in facts["frozen_numel"])
    return {"params": param_bytes * shard, "grads": 4 * shard, "optimizer_states": 8 * shard, "frozen": frozen}


def assert_formula(facts: dict) -> None:
    for numel, n, psi in facts["buffers"]:
        assert numel % n == 0 and psi <= numel
    memory = dict(facts["memory"])
    assert memory.pop("host", 0) == 0, facts  # nothing offloaded to host memory here
    assert memory == {k: v for k, v in expected_bytes(facts, 4).items() if k != "frozen"}, facts
    assert facts["gathered"] == 0 and facts["stored_bytes"] == 0  # between steps no weight is whole
