"""Example models built only from megacann.layers, plus their sizes and FLOPs."""

from megacann.models.sizing import flops_per_token, num_parameters, padded_vocab_size

__all__ = ["flops_per_token", "num_parameters", "padded_vocab_size"]
