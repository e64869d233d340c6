"""A run's tokenizer as files that travel with its weights: into each checkpoint, and out to Hugging Face.

:func:`save_tokenizer` writes any megacann tokenizer as a directory that both megacann
(:func:`~megacann.data.tokenizer.load_tokenizer`) and ``transformers.AutoTokenizer`` load: a
``tokenizers`` JSON (or a SentencePiece ``tokenizer.model``) and a ``tokenizer_config.json`` naming its
special tokens. The byte tokenizer, which has no file, is written as an equivalent ``tokenizer.json``
(byte b is token b, then EOS, BOS, PAD). :func:`tokenizer_record` is what a checkpoint's
``megacann.json`` says about it, and :func:`generation_config` the ``generation_config.json`` of an export.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

from megacann.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
)

TOKENIZER_DIR = "tokenizer"  # a checkpoint's or consolidated directory's copy of the run's tokenizer
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# files of a Hugging Face tokenizer directory kept as they are
EXTRA_FILES = ("special_tokens_map.json", "chat_template.jinja", "chat_template.json")
SPECIAL_KEYS = {"bos": "bos_token", "eos": "eos_token", "pad": "pad_token"}
# the byte tokenizer's special tokens under names megacann's loader recognises (data.tokenizer)
BYTE_SPECIAL_TOKENS = {"eos": "<|endoftext|>", "bos": "<|startoftext|>", "pad": "<|pad|>"}


def tokenizer_record(tokenizer) -> Optional[dict[str, Any]]:
    """How the run tokenized: kind, where it came from, size and special ids (None for a tokenizer that
    cannot be written as files, such as a test's stand-in)."""
    kind = _kind(tokenizer)
    if kind is None:
        return None
    return {
        "kind": kind,
        "source": "byte" if kind == "byte" else tokenizer.path,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "fingerprint": tokenizer.fingerprint,
        "directory": TOKENIZER_DIR,
    }


def _kind(tokenizer) -> Optional[str]:
    if isinstance(tokenizer, HFTokenizer):
        return "hf"
    if isinstance(tokenizer, SentencePieceTokenizer):
        return "sentencepiece"
    if isinstance(tokenizer, ByteTokenizer):
        return "byte"
    return None


def save_tokenizer(tokenizer, directory: str, model_max_length: Optional[int] = None) -> list[str]:
    """Write ``tokenizer`` into ``directory`` (created) so that megacann and transformers load it; returns
    the paths written."""
    kind = _kind(tokenizer)
    if kind is None:
        raise TokenizerError(f"cannot write a {type(tokenizer).__name__} as tokenizer files")
    os.makedirs(directory, exist_ok=True)
    written = []
    if kind == "byte":
        written.append(_write_byte_tokenizer_json(os.path.join(directory, "tokenizer.json")))
        source_dir, tokens = None, dict(BYTE_SPECIAL_TOKENS)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    elif kind == "hf":
        json_file = os.path.join(tokenizer.path, "tokenizer.json") if os.path.isdir(tokenizer.path) else tokenizer.path
        source_dir = os.path.dirname(json_file)
        written.append(_copy(json_file, os.path.join(directory, "tokenizer.json")))
        tokens = _special_tokens(tokenizer)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **_read_json(os.path.join(source_dir, CONFIG_FILE))}
    else:
        source_dir = os.path.dirname(tokenizer.path)
        written.append(_copy(tokenizer.path, os.path.join(directory, "tokenizer.model")))
        tokens = _special_tokens(tokenizer)
        config = {"tokenizer_class": "LlamaTokenizer", **_read_json(os.path.join(source_dir, CONFIG_FILE))}
    for short, key in SPECIAL_KEYS.items():
        if short in tokens:
            config[key] = tokens[short]  # the tokens megacann trained with, whatever the source named
    config.setdefault("clean_up_tokenization_spaces", False)
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if source_dir is not None:
        for name in EXTRA_FILES:
            if os.path.isfile(os.path.join(source_dir, name)):
                written.append(_copy(os.path.join(source_dir, name), os.path.join(directory, name)))
    written.append(_write_json(os.path.join(directory, CONFIG_FILE), config))
    return written


def generation_config(record: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` of an export: the run's begin, end and padding token ids."""
    config = {"bos_token_id": record.get("bos_id"), "eos_token_id": record.get("eos_id")}
    pad = record.get("pad_id")
    config["pad_token_id"] = pad if pad is not None else record.get("eos_id")
    return config


# -- helpers ------------------------------------------------------------------------------------------


def _special_tokens(tokenizer) -> dict[str, str]:
    """The strings of the tokenizer's bos / eos / pad ids (those it has)."""
    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    return {k: tokenizer.id_to_token(i) for k, i in ids.items() if i is not None}


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: each byte as a printable character (the GPT-2 table ``tokenizers`` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write_byte_tokenizer_json(path: str) -> str:
    """A ``tokenizers`` JSON equal to :class:`ByteTokenizer`: UTF-8 byte b is token b, then EOS, BOS, PAD."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = BYTE_SPECIAL_TOKENS
    specials = [names["eos"], names["bos"], names["pad"]]  # ids 256, 257, 258 as ByteTokenizer has them
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    for name, expected in zip(specials, (ByteTokenizer.eos_id, ByteTokenizer.bos_id, ByteTokenizer.pad_id)):
        if tok.token_to_id(name) != expected:
            raise TokenizerError(f"byte tokenizer export: {name} got id {tok.token_to_id(name)}, expected {expected}")
    tok.save(path)
    return path


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _write_json(path: str, value: dict[str, Any]) -> str:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    return path


def _copy(source: str, target: str) -> str:
    if os.path.abspath(source) != os.path.abspath(target):
        shutil.copyfile(source, target)  # contents only: the copy gets ordinary permissions
    return target
