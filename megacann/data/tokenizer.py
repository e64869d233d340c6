"""Tokenizers: a local Hugging Face ``tokenizer.json`` (or directory), a SentencePiece ``.model``, a byte-level
fallback, and training a byte-level BPE with the ``tokenizers`` library. Nothing is ever downloaded.

Every tokenizer exposes ``vocab_size``, ``eos_id``, ``bos_id``, ``pad_id`` (int or None), ``encode(text)``
(no special tokens added: callers add BOS / EOS explicitly), ``encode_batch(texts)``, ``decode(ids)`` and
``fingerprint`` (identifies the vocabulary, for cache keys).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Optional

from megacann.data.cache import digest, file_digest
from megacann.errors import MegacannError

# Names of special tokens recognised when a tokenizer directory does not name them itself.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")

BPE_EOS, BPE_PAD = "<|endoftext|>", "<|pad|>"


class TokenizerError(MegacannError, ValueError):
    """A tokenizer that cannot be found or used."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then EOS 256, BOS 257, PAD 258. Needs no file."""

    vocab_size = 259
    eos_id, bos_id, pad_id = 256, 257, 258
    fingerprint = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json`` (special tokens from the directory's
    ``tokenizer_config.json`` / ``special_tokens_map.json`` when present, else recognised by name)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = os.path.abspath(path)
        json_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = Tokenizer.from_file(json_file)
        except Exception as err:
            raise TokenizerError(f"{json_file}: not a tokenizers JSON file ({err})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        named = _special_tokens_from_dir(os.path.dirname(json_file))
        self.eos_id = self._special_id(named.get("eos_token"), EOS_NAMES)
        self.bos_id = self._special_id(named.get("bos_token"), BOS_NAMES)
        self.pad_id = self._special_id(named.get("pad_token"), PAD_NAMES)
        if self.eos_id is None:
            raise TokenizerError(
                f"{json_file}: no end-of-text token found (looked for eos_token in tokenizer_config.json "
                f"and for {', '.join(EOS_NAMES)})"
            )
        self.fingerprint = file_digest(json_file)

    def _special_id(self, name: Optional[str], fallbacks: Sequence[str]) -> Optional[int]:
        for candidate in ([name] if name else []) + list(fallbacks):
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return int(token_id)
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (LLaMA-1/2 style tokenizers); needs the ``sentencepiece`` package."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError(f"{path}: reading a SentencePiece model needs `pip install sentencepiece`") from None
        self.path = os.path.abspath(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as err:
            raise TokenizerError(f"{path}: not a SentencePiece model ({err})") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id, self.bos_id, self.pad_id = (
            _none_if_negative(self._sp.eos_id()),
            _none_if_negative(self._sp.bos_id()),
            _none_if_negative(self._sp.pad_id()),
        )
        if self.eos_id is None:
            raise TokenizerError(f"{path}: the SentencePiece model has no end-of-sentence token")
        self.fingerprint = file_digest(path)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _none_if_negative(value: int) -> Optional[int]:
    return int(value) if value >= 0 else None


def _special_tokens_from_dir(directory: str) -> dict[str, str]:
    """bos/eos/pad token strings named by tokenizer_config.json or special_tokens_map.json."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later file wins
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        for key in ("bos_token", "eos_token", "pad_token"):
            value = raw.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def load_tokenizer(spec: str):
    """``"byte"``, a ``tokenizer.json``, a directory with ``tokenizer.json`` or ``tokenizer.model``, or a
    SentencePiece ``.model`` file."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return HFTokenizer(path)
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"))
        raise TokenizerError(f"tokenizer directory {spec!r} holds neither tokenizer.json nor tokenizer.model")
    if os.path.isfile(path):
        if path.endswith(".model"):
            return SentencePieceTokenizer(path)
        return HFTokenizer(path)
    raise TokenizerError(
        f"tokenizer {spec!r} not found (expected 'byte', a tokenizer.json, a directory holding tokenizer.json "
        f"or tokenizer.model, or a SentencePiece .model file)"
    )


def train_bpe(texts: Iterable[str], vocab_size: int, output_dir: str, show_progress: bool = False) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (incl. ``<|endoftext|>`` = EOS and ``<|pad|>``) on
    ``texts`` and save it to ``output_dir`` as ``tokenizer.json`` + ``tokenizer_config.json``.
    ``show_progress``: the ``tokenizers`` trainer's own progress bars on stderr (meant for a terminal)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise TokenizerError(f"a byte-level BPE needs vocab_size >= 258 (256 bytes + 2 specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS, BPE_PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(output_dir, exist_ok=True)
    tok.save(os.path.join(output_dir, "tokenizer.json"))
    config = {
        "eos_token": BPE_EOS,
        "pad_token": BPE_PAD,
        "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return HFTokenizer(output_dir)


def tokenizer_fingerprint(tokenizer) -> str:
    """A cache key for any tokenizer object (its own ``fingerprint`` when it has one)."""
    return getattr(tokenizer, "fingerprint", None) or digest(type(tokenizer).__name__, tokenizer.vocab_size)
