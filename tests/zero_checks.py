"""Shared pieces of the ZeRO tests: the recipe overrides of each run, and the world-4 checks that run in
the same spawn as the parity runs (expert-parallel parameters; optimizer state moved between layouts
through the StateShard contract)."""

from __future__ import annotations

import torch

STEPS = 4
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3"]  # clipping active in every step
Z1, Z2 = ["distributed.zero_optimization=1"], ["distributed.zero_optimization=2"]
OVERLAP = ["distributed.overlap_grad_reduce=true", "distributed.overlap_param_gather=true"]
SMALL_BUCKETS = ["distributed.bucket_size_mb=0.02"]  # ~5k elements: about 20 buckets in the tiny model
TP2 = ["distributed.tensor_parallel_size=2"]
# pp 2 x dp 2, the word embedding tied to the last stage's output layer (its own ZeRO bucket on both stages)
PP2_TIED = ["distributed.pipeline_parallel_size=2", "model.tie_word_embeddings=true"]
ACCUM1 = ["optim.grad_accum_steps=1", "data.batch_size=4"]
FP16 = ["model.precision=fp16", "optim.initial_loss_scale=1.2e6"]  # overflows (skips) in steps 1 and 2
BF16 = ["model.precision=bf16"]
FROZEN = ("embed_tokens.weight", "layers.1.mlp.", "layers.2.self_attn.o_proj.weight")


def _expert_check() -> dict:
    """A toy model whose second layer is marked expert-parallel (ep 2 on world 4): ZeRO reduces and shards
    it over the expert-data-parallel group (2 ranks) and the dense layer over all 4, like plain DP does."""
    import torch.distributed as dist
    from training_helpers import tiny_config

    from megacann import parallel_state as ps
    from megacann.layers.sharding import ParamSharding, set_sharding
    from megacann.optimizer import DistributedOptimizer, MixedPrecisionOptimizer

    # the optimizer reads only the groups and the ZeRO settings: the recipe's llama family refuses expert
    # parallelism (it has no experts), so the groups are made here directly
    cfg = tiny_config(COMMON + Z2 + ["distributed.overlap_grad_reduce=true"], 4)
    cfg.distributed.bucket_size_mb = 40 / 2**18  # 40 elements per bucket
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    ep_rank = ps.get_expert_model_parallel_rank()

    def toy() -> torch.nn.ModuleDict:
        torch.manual_seed(0)
        dense = torch.nn.Linear(8, 8)
        torch.manual_seed(1 + ep_rank)  # each expert-parallel rank holds another expert
        expert = torch.nn.Linear(8, 8)
        for p in expert.parameters():
            set_sharding(p, ParamSharding(tuple(p.shape), expert=True))
        return torch.nn.ModuleDict({"dense": dense, "expert": expert})

    models = {"plain": toy(), "zero": toy()}
    optimizers = {
        "plain": MixedPrecisionOptimizer(list(models["plain"].named_parameters()), cfg),
        "zero": DistributedOptimizer(list(models["zero"].named_parameters()), cfg),
    }
    norms = {k: [] for k in models}
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        for key, model in models.items():
            optimizers[key].zero_grad()
            with optimizers[key].last_micro_batch_backward():
                model["expert"](torch.tanh(model["dense"](x))).square().sum().backward()
            optimizers[key].finalize_grads()
            norms[key].append(optimizers[key].step()[1])
    result = {
        "ep_rank": ep_rank,
        "norms": norms,
        "params": {k: {n: p.detach().clone() for n, p in m.named_parameters()} for k, m in models.items()},
        "groups": [(b.params[0].shape, b.group_size) for b in optimizers["zero"].grad_buffers.buffers],
    }
    ps.destroy_model_parallel()
    return result


def _whole_states(optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """What a checkpoint stores: every state tensor whole (TP-unsharded), built from all ranks' StateShards."""
    import torch.distributed as dist

    from megacann import parallel_state as ps
    from megacann.layers.sharding import get_sharding, unshard_tensors

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    mine = [
        (tp_rank, s.name, s.start, s.end, {k: t.clone() for k, t in s.tensors.items()})
        for s in optimizer.state_shards()
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    params = dict(optimizer.named_params)
    local: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for part in everyone:
        for rank, name, start, end, tensors in part:
            for key, t in tensors.items():
                local.setdefault((name, rank), {}).setdefault(key, torch.full((params[name].numel(),), float("nan")))
                local[(name, rank)][key][start:end] = t
    whole = {}
    for name, p in params.items():
        keys = local[(name, 0)]
        shards = {k: [local[(name, r)][k].view(p.shape) for r in range(tp_size)] for k in keys}
        whole[name] = {k: unshard_tensors(v, get_sharding(p)) for k, v in shards.items()}
    return whole


def _load_whole_states(optimizer, whole: dict, scalars: dict) -> None:
    """A checkpoint load under this rank's layout: copy into the StateShard views, then reload the model."""
    from megacann import parallel_state as ps
    from megacann.layers.sharding import get_sharding, shard_tensor

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for s in optimizer.state_shards():
            for key, view in s.tensors.items():
                local = shard_tensor(whole[s.name][key], get_sharding(s.param), tp_rank, tp_size).view(-1)
                view.copy_(local[s.start : s.end])
    optimizer.load_scalar_state(scalars)
    optimizer.reload_model_params()


RESHARD = ["model.vocab_size=256"]  # padded alike under tp 1 and 2, so whole tensors need no re-padding
# tp2 x dp2 accumulates 4 micro-batches of 2 so that its global batch is dp4's (2 x 4 x 2 samples)
RESHARD_TARGETS = {"tp2_zero2": TP2 + Z2 + SMALL_BUCKETS + OVERLAP + ["optim.grad_accum_steps=4"], "plain": []}


def _reshard_check() -> dict:
    """Train dp4 ZeRO-1 for 2 steps, save through the StateShard contract, load into other layouts (tp2 x dp2
    ZeRO-2 with other buckets; dp4 without ZeRO) and train 2 more steps; the uninterrupted run continues too."""
    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.interop.full_state import full_state_dict
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    def trainer_for(overrides: list[str], start_step: int) -> Trainer:
        cfg = tiny_config(COMMON + RESHARD + overrides, world_size=dist.get_world_size())
        runtime = setup_runtime(cfg)
        data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        data.train = data._iterate(start_step)
        trainer = Trainer(cfg, runtime, data=data)
        trainer.state.step = start_step
        return trainer

    results = {}
    source = trainer_for(Z1, 0)
    for _ in range(2):
        source.train_step()
    whole, scalars = _whole_states(source.optimizer), source.optimizer.scalar_state()
    results["source"] = [source.train_step()["loss"] for _ in range(2)]
    source.optimizer.finish_param_sync()
    results["source_params"] = full_state_dict(source.model_chunks)
    ps.destroy_model_parallel()
    for name, overrides in RESHARD_TARGETS.items():
        target = trainer_for(overrides, 2)
        _load_whole_states(target.optimizer, whole, scalars)
        results[name] = [target.train_step()["loss"] for _ in range(2)]
        target.optimizer.finish_param_sync()
        results[f"{name}_params"] = full_state_dict(target.model_chunks)
        ps.destroy_model_parallel()
    return results
