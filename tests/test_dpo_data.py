"""DPO preference data: record forms, response-only masks, malformed lines (error or skip and count), the
token cache, and micro-batches holding whole pairs (chosen then rejected) with their global indices."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megacann.config import ConfigError
from megacann.constants import IGNORE_INDEX
from megacann.data.preference import (
    PreferenceDataError,
    cached_preference_pairs,
    load_preference_pairs,
    parse_preference,
    tokenize_pair,
)
from megacann.data.sft_templates import get_template
from megacann.data.tokenizer import load_tokenizer

BYTE = load_tokenizer("byte")
PLAIN = get_template("plain")


def _write(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _text(ids) -> str:
    return bytes(int(i) for i in ids if int(i) < 256).decode()


def test_the_three_record_forms_give_the_same_prompt():
    plain = parse_preference({"prompt": "Add: 1 + 2", "chosen": "3", "rejected": "4"})
    listed = parse_preference(
        {
            "prompt": [{"role": "user", "content": "Add: 1 + 2"}],
            "chosen": "3",
            "rejected": [{"role": "assistant", "content": "4"}],
        }
    )
    conversations = parse_preference(
        {
            "chosen": [{"role": "user", "content": "Add: 1 + 2"}, {"role": "assistant", "content": "3"}],
            "rejected": [{"role": "user", "content": "Add: 1 + 2"}, {"role": "assistant", "content": "4"}],
        }
    )
    assert plain == listed == conversations == ([{"role": "user", "content": "Add: 1 + 2"}], "3", "4")


def test_only_the_final_response_and_eos_are_trained_with_the_sft_template():
    prompt, chosen, rejected = parse_preference(
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Sum 1 2"},
            ],
            "chosen": "3",
            "rejected": "12",
        }
    )
    chatml = get_template("chatml")
    (c_ids, c_mask), (r_ids, r_mask) = tokenize_pair(prompt, chosen, rejected, chatml, BYTE)
    prompt_len = len(c_ids) - len("3<|im_end|>") - 1
    assert c_ids[:prompt_len].tolist() == r_ids[:prompt_len].tolist()  # one prompt, tokenized once
    assert not c_mask[:prompt_len].any() and c_mask[prompt_len:].all()  # the earlier answer "Hello" is prompt
    assert _text(c_ids[prompt_len:]) == "3<|im_end|>" and c_ids[-1] == BYTE.eos_id
    assert _text(r_ids[np.flatnonzero(r_mask)]) == "12<|im_end|>"
    assert "Hello" in _text(c_ids[:prompt_len]) and "Be brief." in _text(c_ids[:prompt_len])


@pytest.mark.parametrize(
    "record, message",
    [
        ("{not json", "Expecting property name"),
        ({"prompt": "q", "chosen": "a"}, "missing 'rejected'"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' must be a string or a list"),
        ({"prompt": "q", "chosen": ["a"], "rejected": "b"}, "'chosen' must be a string or a list of one"),
        (
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "b"}],
            },
            "equal but for their last message",
        ),
        ({"prompt": [{"role": "assistant", "content": "q"}], "chosen": "a", "rejected": "b"}, "must alternate"),
    ],
)
def test_a_malformed_line_names_file_and_line(tmp_path, record, message):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(PreferenceDataError, match=rf"p\.jsonl:2: malformed preference record: .*{message}"):
        load_preference_pairs(path, BYTE, PLAIN, 64)


def test_bad_lines_are_skipped_and_counted_when_asked(tmp_path, capsys):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = _write(tmp_path / "p.jsonl", [good, "[]", good, "", {"prompt": "q"}])
    samples, stats = load_preference_pairs(path, BYTE, PLAIN, 64, skip_bad_lines=True)
    assert (stats.lines, stats.pairs, stats.bad_lines, len(samples)) == (4, 2, 2, 4)
    assert "p.jsonl:2:" in capsys.readouterr().err


def test_truncation_and_pairs_whose_response_starts_too_late(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "q" * 20, "chosen": "a" * 30, "rejected": "b"},
            {"prompt": "q" * 40, "chosen": "a", "rejected": "b"},
        ],
    )
    samples, stats = load_preference_pairs(path, BYTE, PLAIN, 32)
    assert (stats.pairs, stats.truncated, stats.dropped_too_long) == (1, 1, 1)  # the kept chosen is cut
    assert len(samples[0][0]) == 32 and samples[0][1][1:].any()


def test_tokenized_once_then_read_from_the_cache(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "chosen": "a", "rejected": "bb"} for i in range(5)])
    first, stats, built, directory = cached_preference_pairs(path, BYTE, PLAIN, 32, cache_dir=str(tmp_path / "c"))
    again, _, built_again, same = cached_preference_pairs(path, BYTE, PLAIN, 32, cache_dir=str(tmp_path / "c"))
    assert built and not built_again and directory == same and stats.pairs == 5
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(first, again))


def test_micro_batches_hold_whole_pairs_chosen_first(tmp_path):
    from finetune_helpers import recipe

    from megacann.data import build_data_iterators

    rows = [{"prompt": f"Reverse: w{i}", "chosen": f"w{i}"[::-1], "rejected": f"w{i}"} for i in range(30)]
    path = _write(tmp_path / "p.jsonl", rows)
    cfg = recipe(
        [
            "train_mode=dpo",
            f"data.path={path}",
            "data.tokenizer=byte",
            "data.prompt_template=plain",
            f"data.cache_dir={tmp_path}/c",
            "data.split=80,20,0",
            "data.batch_size=4",
            "model.vocab_size=260",
        ]
    )
    data = build_data_iterators(cfg, BYTE, dp_rank=1, dp_size=2)
    batch = next(data.train)
    assert batch["tokens"].shape == (4, 32)
    index = batch["sequence_index"].tolist()
    assert [i % 2 for i in index] == [0, 1, 0, 1] and index[1] == index[0] + 1 and index[3] == index[2] + 1
    for k in (0, 2):  # same prompt, chosen then rejected; the loss only on the responses
        chosen, rejected = batch["tokens"][k], batch["tokens"][k + 1]
        word = _text(chosen).split("Reverse: ")[1].split("\n")[0]
        answer = [int(t) for t in batch["labels"][k] if t != IGNORE_INDEX]
        assert _text(answer) == word[::-1] and answer[-1] == BYTE.eos_id
        assert _text([int(t) for t in batch["labels"][k + 1] if t != IGNORE_INDEX]) == word
        assert _text(rejected).startswith(f"Reverse: {word}\n")
    held_out = next(data.valid())["sequence_index"].tolist()
    assert min(held_out) >= 2 * 24  # the last 20% of the pairs


def test_a_dpo_recipe_is_checked(tmp_path):
    from finetune_helpers import recipe

    with pytest.raises(ConfigError, match="data.batch_size 3 must be even with train_mode dpo"):
        recipe(["train_mode=dpo", "data.batch_size=3"])
    with pytest.raises(ConfigError, match="dpo.reference adapters_off needs lora: true"):
        recipe(["train_mode=dpo", "dpo.reference=adapters_off"])
    with pytest.raises(ConfigError, match="dpo.loss_type: 'kto' is not one of sigmoid, ipo, simpo"):
        recipe(["train_mode=dpo", "dpo.loss_type=kto"])
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing must be in \[0, 0.5\)"):
        recipe(["train_mode=dpo", "dpo.label_smoothing=0.5"])
    with pytest.raises(ConfigError, match=r"dpo.sft_loss_weight must be a finite number >= 0 .* got -0.5"):
        recipe(["train_mode=dpo", "dpo.sft_loss_weight=-0.5"])
    cfg = recipe(["train_mode=dpo"])
    assert (cfg.optim.lr, cfg.optim.warmup_ratio) == (1e-6, 0.1)  # the DPO defaults
