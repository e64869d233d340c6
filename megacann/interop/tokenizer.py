"""The tokenizer that travels with the weights: written into each checkpoint, found again for an export.

:class:`TokenizerFiles` is what a training loop hands its checkpoints (``CheckpointParts(files=...)``): a
checkpoint then holds a copy of the run's tokenizer in ``tokenizer/``, named in ``megacann.json`` (see
:mod:`megacann.data.tokenizer_files`), and so does a consolidated directory made from it. A checkpoint
written before that copy existed names its tokenizer only in its recipe (``config.yaml``): ``data.tokenizer``,
or when that is empty the default corpus's BPE in the cache, which is used if it is still there (it is
never trained again here), and only if it fits the model's vocabulary (a run on data of its own may have
used another).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import yaml

from megacann.config import ModelConfig
from megacann.data.tokenizer import TokenizerError, load_tokenizer
from megacann.data.tokenizer_files import save_tokenizer, tokenizer_record
from megacann.interop.names import RECIPE_FILE, TOKENIZER_DIR
from megacann.interop.sources import CHECKPOINT, HUGGINGFACE, resolve_weight_source


class TokenizerFiles:
    """The run's tokenizer as files saved beside the weights of every checkpoint (``tokenizer/``), so that
    exports carry it; ``megacann.json`` names it under ``tokenizer``. A tokenizer that cannot be written
    as files (e.g. a test's stand-in) is kept out."""

    key = "tokenizer"

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def record(self) -> Optional[dict[str, Any]]:
        """What ``megacann.json`` says about the tokenizer, or None to save nothing."""
        return tokenizer_record(self.tokenizer)

    def write(self, directory: str, info: dict[str, Any]) -> list[str]:
        """Write the tokenizer into the checkpoint ``directory`` being saved; returns the paths written."""
        limit = info["model"].get("max_position_embeddings")
        return save_tokenizer(self.tokenizer, os.path.join(directory, TOKENIZER_DIR), limit)


def find_tokenizer(path: str, is_checkpoint: bool, vocab_size: Optional[int]) -> tuple[Optional[Any], str]:
    """(tokenizer, where it was found) for a checkpoint or consolidated directory whose model has
    ``vocab_size`` rows; (None, why not) when there is none."""
    saved = os.path.join(path, TOKENIZER_DIR)
    if os.path.isdir(saved):
        return load_tokenizer(saved), saved
    if not is_checkpoint:
        return None, f"{path} holds no {TOKENIZER_DIR}/ directory"
    tokenizer, what = _from_recipe(path)
    if tokenizer is None:
        return None, f"{path} holds no {TOKENIZER_DIR}/ and {what}"
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        return None, (
            f"{path} holds no {TOKENIZER_DIR}/ and {what} has {tokenizer.vocab_size} tokens, more than the "
            f"model's vocab_size {vocab_size}: the run tokenized its data otherwise"
        )
    return tokenizer, f"{what} (the checkpoint holds no copy)"


def _from_recipe(path: str) -> tuple[Optional[Any], str]:
    """(the tokenizer the checkpoint's recipe names, what it is), or (None, what it is and why unusable)."""
    recipe = os.path.join(path, RECIPE_FILE)
    if not os.path.isfile(recipe):
        return None, f"no {RECIPE_FILE} names one"
    with open(recipe) as f:
        data = (yaml.safe_load(f) or {}).get("data") or {}
    spec = data.get("tokenizer")
    if spec is None:
        from megacann.data.default_corpus import corpus_dir

        vocab = data.get("tokenizer_vocab_size", 8192)
        spec = os.path.join(corpus_dir(data.get("cache_dir")), f"tokenizer-v{vocab}")
        what = f"the default BPE ({vocab} tokens) its recipe used"
        if not os.path.isfile(os.path.join(spec, "tokenizer.json")):
            return None, f"{what} is no longer cached at {spec}"
    else:
        what = f"its recipe's data.tokenizer {spec!r}"
    try:
        return load_tokenizer(spec), what
    except TokenizerError as err:
        return None, f"{what} is not readable: {err}"


def source_tokenizer(source: str, cfg: ModelConfig, log: Callable[[str], None]) -> Optional[Any]:
    """The tokenizer the source's weights were trained with (said where it came from), or None (said why)."""
    found = resolve_weight_source(source, "source")
    if found.kind == HUGGINGFACE:
        try:
            tokenizer, where = load_tokenizer(found.path), found.path
        except TokenizerError as err:
            tokenizer, where = None, str(err)
    else:
        tokenizer, where = find_tokenizer(found.path, found.kind == CHECKPOINT, cfg.vocab_size)
    if tokenizer is None:
        log(f"no tokenizer to export: {where}")
        return None
    if cfg.vocab_size is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer from {where} has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
            f"{cfg.vocab_size}: it is not the tokenizer these weights were trained with"
        )
    log(f"tokenizer: {where}")
    return tokenizer
