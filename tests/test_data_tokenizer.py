"""Tokenizers: byte fallback, BPE training and reloading, SentencePiece, and clear errors."""

import json

import pytest

from megacann.config import MegacannConfig
from megacann.data import build_tokenizer
from megacann.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer, train_bpe

TEXTS = [f"def function_{i}(x):\n    return x * {i} + len('naïve ☕')\n" for i in range(200)]


def test_byte_tokenizer_round_trip_and_specials():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (256, 257, 258)
    ids = tok.encode("naïve ☕")
    assert max(ids) < 256 and tok.decode(ids + [tok.eos_id]) == "naïve ☕"


def test_train_bpe_saves_a_reloadable_tokenizer(tmp_path):
    tok = train_bpe(TEXTS, 300, str(tmp_path / "bpe"))
    assert tok.vocab_size == 300 and tok.pad_id is not None and tok.bos_id is None
    text = "def function_7(x):\n    return 'café'\n"
    assert tok.decode(tok.encode(text)) == text
    for spec in (str(tmp_path / "bpe"), str(tmp_path / "bpe" / "tokenizer.json")):
        again = load_tokenizer(spec)
        assert isinstance(again, HFTokenizer)
        assert (again.vocab_size, again.eos_id, again.pad_id) == (tok.vocab_size, tok.eos_id, tok.pad_id)
        assert again.encode(text) == tok.encode(text) and again.fingerprint == tok.fingerprint
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode()) / 2  # merges were learnt


def test_special_tokens_named_by_tokenizer_config(tmp_path):
    train_bpe(TEXTS, 300, str(tmp_path / "t"))
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|pad|>"}}))
    tok = load_tokenizer(str(tmp_path / "t"))
    assert tok.eos_id == tok._tok.token_to_id("<|pad|>")


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=80, minloglevel=2, bos_id=1, eos_id=2
    )
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, None, 80)
    assert tok.decode(tok.encode("return x * 3")) == "return x * 3"
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    assert load_tokenizer(str(tmp_path / "dir")).vocab_size == 80


def test_missing_tokenizer_names_the_key(tmp_path):
    cfg = MegacannConfig()
    cfg.data.tokenizer = str(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match=r"data\.tokenizer.*nowhere.*not found"):
        build_tokenizer(cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(str(tmp_path / "empty"))
    cfg.data.tokenizer = "byte"
    assert build_tokenizer(cfg).vocab_size == 259


def test_bpe_training_is_deterministic(tmp_path):
    a = train_bpe(TEXTS * 3, 400, str(tmp_path / "a"))
    b = train_bpe(TEXTS * 3, 400, str(tmp_path / "b"))
    assert a.fingerprint == b.fingerprint  # the same bytes of tokenizer.json
