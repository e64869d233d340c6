"""What each rank of a fuzzed layout really ran (tests/layout_fuzz.py reads these after training and checks
them against the layout): block forwards and recomputes per chunk, the sequence length a block sees, the
pipeline stage, local experts, tensor-parallel shards (LoRA adapters' included), trainable parameters, the
objective (DPO's reference), the optimizer's classes and the optimizer-state elements that show the ZeRO
stage in force."""

from __future__ import annotations

INNER_OPTIMIZERS = {"adamw": "RegistryAdamW", "adam": "Adam", "sgd": "SGD"}  # optim.name -> the class built
STATES_PER_ELEMENT = {"adamw": 2, "adam": 2, "sgd": 1}  # fp32 state tensors per parameter element
ZERO_SLACK = 0.01  # a shard may own a few elements more or less than its share (padding to the group size)


def probe(trainer) -> dict:
    """What each rank really ran: block forwards per chunk and the sequence length a block sees (hooks),
    how often backward replayed a block and core attention (recompute), its pipeline stage, its local experts
    per MoE layer, trainable parameter names, what the objective's reference is, the optimizer's class."""
    from megacann import parallel_state as ps
    from megacann.layers import TransformerBlock
    from megacann.layers.moe.layer import MoELayer
    from megacann.layers.random import is_recomputing
    from megacann.optimizer.zero.optimizer import DistributedOptimizer

    seen = {"forwards": [0] * len(trainer.model_chunks), "seq": set(), "recomputes": 0, "core_recomputes": 0}
    for index, chunk in enumerate(trainer.model_chunks):
        for block in (m for m in chunk.modules() if isinstance(m, TransformerBlock)):

            def hook(module, args, index=index):
                if is_recomputing():
                    seen["recomputes"] += 1
                else:
                    seen["forwards"][index] += 1
                    seen["seq"].add(args[0].shape[1])

            block.input_layernorm.register_forward_pre_hook(hook)
        for attention in (m for m in chunk.modules() if hasattr(m, "recompute_core_attention")):
            core = attention.core_attention

            def counted(*args, core=core, **kwargs):
                seen["core_recomputes"] += is_recomputing()
                return core(*args, **kwargs)

            attention.core_attention = counted  # looked up per call, also by the selective checkpoint
    seen["pp_rank"] = ps.get_pipeline_model_parallel_rank()
    seen["local_experts"] = sorted(
        {m.dispatcher.num_local_experts for c in trainer.model_chunks for m in c.modules() if isinstance(m, MoELayer)}
    )
    seen["trainable"] = sorted(n for c in trainer.model_chunks for n, p in c.named_parameters() if p.requires_grad)
    seen["tp_splits"] = _tp_splits(trainer.model_chunks)
    seen["objective"] = getattr(trainer.objective, "kind", "per-token")  # DPO: where the reference comes from
    seen["optimizer"] = type(trainer.optimizer).__name__
    seen["inner_optimizer"] = type(trainer.optimizer.optimizer).__name__
    seen["sharded"] = isinstance(trainer.optimizer, DistributedOptimizer)
    seen["offloaded"] = getattr(trainer.optimizer, "offload", None) is not None
    return seen


def _tp_splits(chunks) -> list[int]:
    """By how much each tensor-parallel linear layer's local weight is smaller than the whole one, along its
    split dimension (output features of a column-parallel layer, input features of a row-parallel one), and
    likewise its LoRA adapter's matrix split with it (``B``'s rows, ``A``'s columns); layers kept whole on
    purpose (``replicated``) are left out."""
    from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear

    splits = set()
    for module in (m for c in chunks for m in c.modules()):
        adapter = module.adapter if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) else None
        if isinstance(module, ColumnParallelLinear) and not module.replicated:
            splits.add(module.output_size // module.weight.shape[0])
            if adapter is not None:
                splits.add(sum(adapter.chosen) // adapter.lora_B.shape[0])
        elif isinstance(module, RowParallelLinear):
            splits.add(module.input_size // module.weight.shape[1])
            if adapter is not None:
                splits.add(module.input_size // adapter.lora_A.shape[1])
    return sorted(splits)


def state_probe(trainer) -> dict:
    """Per rank, after training: the elements (fp32, 4 bytes each) of the optimizer's state tensors (Adam's
    moments, SGD's momentum; step counters left out) and of the trainable parameters it updates, dense and
    expert apart (they are sharded over different groups): ZeRO shows as state for a share of them only."""
    from megacann.layers.sharding import get_sharding

    state = sum(t.numel() for s in trainer.optimizer.optimizer.state.values() for t in s.values() if _has_elements(t))
    params = [p for c in trainer.model_chunks for p in c.parameters() if p.requires_grad]
    expert = sum(p.numel() for p in params if get_sharding(p).expert)
    return {"state_elems": state, "expert_elems": expert, "dense_elems": sum(p.numel() for p in params) - expert}


def _has_elements(value) -> bool:
    """A state tensor with elements of its own (not a 0-d step counter)."""
    import torch

    return isinstance(value, torch.Tensor) and value.dim() > 0


def expected_state(probes: dict, optimizer: str, zero: int, shard_group: int, ep: int) -> float:
    """The optimizer-state elements one rank should hold: Adam's two moments (SGD's one momentum) for every
    trainable element it updates; under ZeRO (any stage) only its share, dense parameters over the
    data x context ranks, expert ones over those divided by expert parallelism."""
    per_element = STATES_PER_ELEMENT[optimizer]
    if zero == 0:
        return per_element * (probes["dense_elems"] + probes["expert_elems"])
    return per_element * (probes["dense_elems"] / shard_group + probes["expert_elems"] / (shard_group // ep))
