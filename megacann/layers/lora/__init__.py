"""LoRA (low-rank adaptation) on megacann's layers, sharded like the layer each adapter adapts.

- :mod:`.targets`: which projections a LoRA adapts (names, fused projections and their parts) and the
  settings (:class:`LoRAConfig`);
- :mod:`.adapter`: one adapter (:class:`LoRAAdapter`) in the ``adapter`` slot of a column- or
  row-parallel linear layer, and its layout over tensor-parallel ranks;
- :mod:`.experts`: adapters on MoE experts' projections, computed with grouped matmuls;
- :mod:`.attach`: a whole model: attach, list, re-draw, merge, unmerge, unload and
  temporarily disable adapters.

Fine-tuning with it from a recipe: docs/finetuning.md; PEFT import and export use the same target rules.
"""

from megacann.layers.lora.adapter import AdapterLayout, LoRAAdapter, adapter_layout, is_lora_parameter
from megacann.layers.lora.attach import (
    adapters_disabled,
    attach_lora,
    count_parameters,
    init_adapters_,
    lora_adapters,
    lora_parameters,
    merge_lora,
    unload_lora,
    unmerge_lora,
)
from megacann.layers.lora.experts import expert_layers_elsewhere
from megacann.layers.lora.targets import (
    ALL_PROJECTIONS,
    FUSED_PROJECTIONS,
    HF_PROJECTIONS,
    PROJECTION_NAMES,
    LoRAConfig,
    LoRATarget,
    resolve_target,
)

__all__ = [
    "ALL_PROJECTIONS",
    "FUSED_PROJECTIONS",
    "HF_PROJECTIONS",
    "PROJECTION_NAMES",
    "AdapterLayout",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRATarget",
    "adapter_layout",
    "adapters_disabled",
    "attach_lora",
    "count_parameters",
    "expert_layers_elsewhere",
    "init_adapters_",
    "is_lora_parameter",
    "lora_adapters",
    "lora_parameters",
    "merge_lora",
    "resolve_target",
    "unload_lora",
    "unmerge_lora",
]
