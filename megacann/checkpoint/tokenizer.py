"""The tokenizer a checkpoint's weights were trained with, found for an export.

A checkpoint saved by the trainer holds a copy in ``tokenizer/`` (named in ``megacann.json``; see
:mod:`megacann.data.tokenizer_files`), and so does a consolidated directory made from it. A checkpoint
written before that copy existed names its tokenizer only in its recipe (``config.yaml``): ``data.tokenizer``,
or when that is empty the default corpus's BPE in the cache, which is used if it is still there (it is
never trained again here), and only if it fits the model's vocabulary (a run on data of its own may have
used another).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import yaml

from megacann.checkpoint.metadata import RECIPE_FILE
from megacann.data.tokenizer import TokenizerError, load_tokenizer
from megacann.data.tokenizer_files import TOKENIZER_DIR


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
