"""Weights in and out: Hugging Face and PEFT import/export, consolidation, the tokenizer that travels with
the weights, and the one answer to "what kind of weights directory is this".

- :mod:`~megacann.interop.sources`: :func:`resolve_weight_source` (checkpoint, output directory, consolidated
  or Hugging Face directory) and the identity (fingerprint) of a LoRA run's base;
- :mod:`~megacann.interop.reading`: whole weights on one process (:func:`read_weights`), or straight into
  this rank's shards (:func:`load_source_weights`, ``model.init_from``);
- :mod:`~megacann.interop.model_source`: ``model.init_from``'s architecture into a recipe
  (:func:`apply_model_source`);
- :mod:`~megacann.interop.hf`: Hugging Face directories of any family with an adapter
  (:func:`from_pretrained_hf`, :func:`save_pretrained_hf`); :mod:`~megacann.interop.quantized`: their
  block-scaled fp8 weights dequantised as they are read, other quantisations refused;
- :mod:`~megacann.interop.export` and :mod:`~megacann.interop.lora_export`: what ``megacann-convert`` does
  (consolidate, to-hf, from-hf, merge-lora, to-peft); :mod:`~megacann.interop.peft`: PEFT's LoRA format;
- :mod:`~megacann.interop.snapshot`: a Hugging Face directory of a live model at any layout, written during
  training (:func:`save_hf_snapshot`, ``logging.hf_save_interval``); :mod:`~megacann.interop.streaming`:
  the same weights streamed in buckets to a serving engine (:func:`stream_hf_weights`);
- :mod:`~megacann.interop.tokenizer`: :class:`TokenizerFiles` (the run's tokenizer in every checkpoint) and
  finding it again for an export; :mod:`~megacann.interop.names`: every file name, defined once.

Layering: interop reads :mod:`megacann.checkpoint` (training state) and builds models through their
families; neither of those imports interop. Names are imported on first use, so that importing one module (e.g.
:mod:`~megacann.interop.full_state` from the trainer) does not load the rest.
"""

from __future__ import annotations

from megacann.lazy_exports import lazy_exports

_EXPORTS = {
    "consolidate": "export",
    "export_hf": "export",
    "import_hf": "export",
    "full_state_dict": "full_state",
    "load_full_state_dict_": "full_state",
    "from_pretrained_hf": "hf",
    "save_pretrained_hf": "hf",
    "build_full_model": "lora_export",
    "export_peft_checkpoint": "lora_export",
    "merge_lora_checkpoint": "lora_export",
    "apply_model_source": "model_source",
    "load_peft_adapter": "peft",
    "save_peft_adapter": "peft",
    "load_source_weights": "reading",
    "read_checkpoint_weights": "reading",
    "read_weights": "reading",
    "WeightSource": "sources",
    "resolve_weight_source": "sources",
    "save_hf_snapshot": "snapshot",
    "load_into_module": "streaming",
    "stream_hf_weights": "streaming",
    "TokenizerFiles": "tokenizer",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
