"""Generation at the training layout: prefill plus key/value-cache decoding of batches of requests,
sampling with a seed per request, and each token's log-probability (:mod:`.generator`, :mod:`.kv_cache`,
:mod:`.micro_batches`, :mod:`.latent_cache`, :mod:`.compressed_cache`, :mod:`.recurrent_cache`,
:mod:`.sampling`, :mod:`.stops`, :mod:`.chat`). Knows models only through the contract
(``ModelSpec.decode``) and the layers; see docs/generation.md."""

from megacann.generation.compressed_cache import CompressedAttentionCacheLayer, compressed_cache_bytes
from megacann.generation.generator import GenerationResult, Generator, sequence_parallel_off
from megacann.generation.kv_cache import KVCache, kv_cache_bytes, register_cache_layer
from megacann.generation.latent_cache import LatentCacheLayer, latent_cache_bytes
from megacann.generation.recurrent_cache import RecurrentCacheLayer, recurrent_cache_bytes
from megacann.generation.sampling import SamplingParams, processed_logits
from megacann.generation.stops import StopStrings

__all__ = [
    "CompressedAttentionCacheLayer",
    "GenerationResult",
    "Generator",
    "KVCache",
    "LatentCacheLayer",
    "RecurrentCacheLayer",
    "SamplingParams",
    "StopStrings",
    "compressed_cache_bytes",
    "kv_cache_bytes",
    "latent_cache_bytes",
    "processed_logits",
    "recurrent_cache_bytes",
    "register_cache_layer",
    "sequence_parallel_off",
]
