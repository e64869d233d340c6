"""Generation at the training layout: prefill plus key/value-cache decoding of batches of requests,
sampling with a seed per request, and each token's log-probability (:mod:`.generator`,
:mod:`.kv_cache`, :mod:`.sampling`, :mod:`.stops`, :mod:`.chat`). Knows models only through the contract (``ModelSpec.decode``) and
the layers; see docs/generation.md."""

from megacann.generation.generator import GenerationResult, Generator, sequence_parallel_off
from megacann.generation.kv_cache import KVCache, kv_cache_bytes
from megacann.generation.sampling import SamplingParams, processed_logits
from megacann.generation.stops import StopStrings

__all__ = [
    "GenerationResult",
    "Generator",
    "KVCache",
    "SamplingParams",
    "StopStrings",
    "kv_cache_bytes",
    "processed_logits",
    "sequence_parallel_off",
]
