"""SFT data: templates, prompt tokens without loss, packing without crossing samples, truncation, bad lines."""

import json

import pytest
import torch
import torch.nn.functional as F
from data_fixtures import tiny_cfg

from megacann.data import build_data_iterators
from megacann.data.sft import SFTDataError, load_sft_samples, tokenize_conversation
from megacann.data.sft_dataset import SFTDataset
from megacann.data.sft_templates import get_template
from megacann.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def sft_iterators(tmp_path, records, seq_length=64, batch_size=2, steps=2, **data):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    cfg = tiny_cfg(tmp_path, path=path, seq_length=seq_length, batch_size=batch_size, max_steps=steps, split="100,0,0")
    cfg.train_mode = "sft"
    cfg.data.prompt_template = "plain"
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return build_data_iterators(cfg, TOK)


def trivial_loss(batch):
    """Cross entropy against fixed logits that do not depend on the inputs: only labels can move it."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch["labels"].shape, TOK.vocab_size, generator=gen)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")


def test_only_answer_tokens_carry_loss():
    messages = [{"role": "user", "content": "Add 2 and 3", "input": ""}, {"role": "assistant", "content": "5"}]
    ids, trained = tokenize_conversation(messages, get_template("alpaca"), TOK)
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
    assert TOK.decode(ids[trained].tolist()) == "5" and trained.sum() == 2  # "5" and EOS
    assert TOK.decode(ids[~trained].tolist()).endswith("### Instruction:\nAdd 2 and 3\n\n### Response:\n")


def test_changing_prompt_tokens_does_not_change_the_loss(tmp_path):
    a = {"instruction": "Name a colour.", "input": "warm", "output": "Red."}
    b = {"instruction": "Give a number!", "input": "cold", "output": "Red."}  # same lengths, other prompt
    c = {"instruction": "Name a colour.", "input": "warm", "output": "Tan."}
    losses = []
    for i, record in enumerate((a, b, c)):
        data = sft_iterators(
            tmp_path / str(i), [record], seq_length=256, batch_size=1, pack_sft=False, prompt_template="alpaca"
        )
        batch = next(data.train)
        labels, tokens = batch["labels"][0], batch["tokens"][0]
        n = int((tokens != TOK.pad_id).sum())
        assert (labels[labels != -100] == tokens[1:n][labels[: n - 1] != -100]).all()
        losses.append(trivial_loss(batch).item())
    assert losses[0] == losses[1] and losses[0] != losses[2]


def test_chat_messages_multi_turn_train_every_assistant_turn():
    record = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao."},
    ]
    ids, trained = tokenize_conversation(record, get_template("chatml"), TOK)
    assert TOK.decode(ids[trained].tolist()) == "Hello.<|im_end|>Ciao.<|im_end|>"
    prompt = TOK.decode(ids[~trained].tolist())
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_custom_template_string():
    template = get_template("Q: {instruction} ({input})\nA: ")
    ids, trained = tokenize_conversation(
        [{"role": "user", "content": "why", "input": ""}, {"role": "assistant", "content": "because"}], template, TOK
    )
    assert TOK.decode(ids[~trained].tolist()) == "Q: why ()\nA: "
    with pytest.raises(ValueError, match="data.prompt_template"):
        get_template("no placeholder")


def test_packing_resets_positions_and_blocks_attention_between_samples(tmp_path):
    records = [{"instruction": "q" * n, "output": "a" * n} for n in (3, 5, 2, 4, 6, 1)]
    data = sft_iterators(tmp_path, records, seq_length=48, batch_size=1, steps=2)
    ds = data.train_dataset
    assert ds.samples_per_epoch < len(records) and ds.fill_ratio > 0.5
    for batch in data.train:
        tokens, labels = batch["tokens"][0], batch["labels"][0]
        pos, seg = batch["position_ids"][0], batch["segment_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist()
        for s, e in zip(starts, starts[1:] + [48]):
            assert (seg[s:e] == seg[s]).all()  # one segment per sample (or the padding)
            assert pos[s:e].tolist() == list(range(e - s))
            assert labels[e - 1] == -100  # no target crosses into the next sample
        samples = [s for s in starts if tokens[s] == TOK.bos_id]
        assert len(samples) >= 2 and len(set(seg.tolist())) == len(starts)
        pad = tokens == TOK.pad_id
        assert (labels[pad] == -100).all()


def test_without_packing_one_sample_per_sequence(tmp_path):
    data = sft_iterators(tmp_path, [{"instruction": "q", "output": "a"}] * 4, seq_length=64, pack_sft=False)
    batch = next(data.train)
    assert "segment_ids" not in batch and (batch["tokens"][:, 0] == TOK.bos_id).all()
    assert ((batch["labels"] != -100).sum(dim=1) == 2).all()  # "a" and EOS


def test_truncation_keeps_the_start_and_drops_samples_without_answer(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"instruction": "short", "output": "x" * 100}, {"instruction": "p" * 100, "output": "late"}],
    )
    samples, stats = load_sft_samples([path], TOK, get_template("plain"), seq_length=32)
    assert len(samples) == 1 and stats.truncated == 1 and stats.dropped_too_long == 1
    ids, trained = samples[0]
    assert len(ids) == 32 and TOK.decode(ids[1:7].tolist()) == "short\n" and trained[-1]


def test_bad_line_names_file_and_line_or_is_skipped_and_counted(tmp_path):
    good = {"instruction": "i", "output": "o"}
    lines = [good, "", good, '{"instruction": "no output"}', "{not json", good]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(SFTDataError, match=r"bad\.jsonl:4: .*'instruction' and 'output'.*skip_bad_lines"):
        load_sft_samples([path], TOK, get_template("alpaca"), 256)
    samples, stats = load_sft_samples([path], TOK, get_template("alpaca"), 256, skip_bad_lines=True)
    assert len(samples) == 3 and stats.bad_lines == 2 and "bad.jsonl:5" in stats.first_errors[1]
    with pytest.raises(SFTDataError, match=r"sft\.jsonl:4"):
        sft_iterators(tmp_path, lines)
    assert sft_iterators(tmp_path, lines, skip_bad_lines=True).train_samples == 2 * 2


def test_messages_must_alternate_and_end_with_assistant(tmp_path):
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    path = write_jsonl(tmp_path / "m.jsonl", [bad])
    with pytest.raises(SFTDataError, match=r"m\.jsonl:1: .*alternate"):
        load_sft_samples([path], TOK, get_template("chatml"), 64)


def test_sft_epochs_visit_every_pack(tmp_path):
    samples = [
        tokenize_conversation(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": str(i)}], get_template("plain"), TOK
        )
        for i in range(10)
    ]
    ds = SFTDataset(samples, seq_length=16, seed=3, pad_id=TOK.pad_id).prepare(20)
    n = ds.samples_per_epoch
    first = sorted(tuple(ds[i]["tokens"].tolist()) for i in range(n))
    second = sorted(tuple(ds[i]["tokens"].tolist()) for i in range(n, 2 * n))
    assert first == second
