"""The RL loop's pure parts: prompts read from JSONL (chat messages through the SFT template, errors naming
file:line), the seeded prompt order, the overlong penalty, rollout micro-batches and the console line."""

from __future__ import annotations

import json

import pytest
import torch

from megacann.constants import IGNORE_INDEX
from megacann.data.sft_templates import get_template
from megacann.data.tokenizer import ByteTokenizer
from megacann.rl.prompts import PromptDataError, PromptOrder, read_prompts
from megacann.rl.rollout import Rollout, overlong_penalty, rollout_micro_batches
from megacann.training.metrics import format_step_line


def _write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_prompts_and_chat_messages_become_token_ids_with_their_records(tmp_path):
    tok = ByteTokenizer()
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "Reverse: abc\n", "answer": "cba"},
            "",
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "n": 3},
        ],
    )
    first, chat = read_prompts(path, tok, get_template("chatml"), max_prompt_tokens=100)
    assert first.text == "Reverse: abc\n" and first.record["answer"] == "cba" and first.where == f"{path}:1"
    assert list(first.ids) == [tok.bos_id, *tok.encode("Reverse: abc\n")]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.text == expected and chat.where == f"{path}:3" and chat.record["n"] == 3


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", ":1: malformed prompt record"),
        ({"question": "x"}, ":1: malformed prompt record: expected a 'prompt' string or a 'messages' list"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "end with a user"),
        ({"prompt": "x" * 40}, ":1: the prompt has 41 tokens, more than the 30 that data.seq_length leaves"),
    ],
)
def test_bad_prompt_lines_are_named(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [line])
    with pytest.raises(PromptDataError) as err:
        read_prompts(path, ByteTokenizer(), get_template("plain"), max_prompt_tokens=30)
    assert message in str(err.value) and str(err.value).startswith(path)


def test_missing_or_empty_prompt_files_are_refused(tmp_path):
    with pytest.raises(PromptDataError, match="rl.prompts: .*nowhere.jsonl is not a file"):
        read_prompts(str(tmp_path / "nowhere.jsonl"), ByteTokenizer(), get_template("plain"), 30)
    with pytest.raises(PromptDataError, match="holds no prompt"):
        read_prompts(_write(tmp_path / "empty.jsonl", [""]), ByteTokenizer(), get_template("plain"), 30)


def test_prompt_order_walks_seeded_epochs_and_draws_extra_rounds_afresh():
    order = PromptOrder(10, seed=3)
    steps = [order.step_prompts(step, 0, 4) for step in range(5)]  # 20 positions: two epochs
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:] and flat[:10] != list(range(10))
    assert PromptOrder(10, seed=3).step_prompts(3, 0, 4) == steps[3]  # a resumed run: the same prompts
    assert PromptOrder(10, seed=4).step_prompts(0, 0, 4) != steps[0]
    extra = order.step_prompts(2, 1, 4)
    assert extra == PromptOrder(10, seed=3).step_prompts(2, 1, 4) and extra != order.step_prompts(2, 2, 4)


def test_overlong_penalty_is_dapos_linear_ramp():
    assert [overlong_penalty(n, 10, 4, 1.0) for n in (5, 6, 7, 8, 10)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(10, 10, 0, 1.0) == 0.0


def test_rollout_rows_label_the_response_and_carry_its_logprobs():
    tok = ByteTokenizer()

    class P:
        ids = (tok.bos_id, 65, 66)

    rollout = Rollout(0, 0, [67, tok.eos_id], [-0.5, -0.25], "eos")
    (batch,) = rollout_micro_batches([P], [rollout], [1.5], seq_length=8, batch_size=4, pad_id=tok.pad_id)
    assert batch["tokens"][0].tolist() == [tok.bos_id, 65, 66, 67, tok.eos_id, tok.pad_id, tok.pad_id, tok.pad_id]
    ignore = IGNORE_INDEX
    assert batch["labels"][0].tolist() == [ignore, ignore, 67, tok.eos_id, ignore, ignore, ignore, ignore]
    assert batch["rollout_logps"][0].tolist() == [0, 0, -0.5, -0.25, 0, 0, 0, 0]
    assert batch["advantages"].tolist() == [1.5] and batch["position_ids"][0].tolist() == list(range(8))


def test_rollout_rows_of_different_lengths_fill_micro_batches_row_by_row():
    tok, ignore = ByteTokenizer(), IGNORE_INDEX

    class Short:
        ids = (tok.bos_id, 65)

    class Long:
        ids = (tok.bos_id, 65, 66, 67, 68)

    rollouts = [
        Rollout(1, 0, [70, 71, 72], [-0.5, -0.25, -2.0], "length"),  # fills the row: 8 tokens
        Rollout(0, 1, [tok.eos_id], [-1.0], "eos"),
        Rollout(0, 2, [69, 70], [-0.125, -4.0], "length"),
    ]
    first, second = rollout_micro_batches([Short, Long], rollouts, [1.0, -1.0, 0.5], 8, 2, tok.pad_id)
    pad = tok.pad_id
    assert first["tokens"].tolist() == [
        [tok.bos_id, 65, 66, 67, 68, 70, 71, 72],
        [tok.bos_id, 65, tok.eos_id, pad, pad, pad, pad, pad],
    ]
    assert first["labels"].tolist() == [
        [ignore] * 4 + [70, 71, 72] + [ignore],
        [ignore, tok.eos_id] + [ignore] * 6,
    ]
    assert first["rollout_logps"].tolist() == [[0, 0, 0, 0, -0.5, -0.25, -2.0, 0], [0, -1.0, 0, 0, 0, 0, 0, 0]]
    assert second["tokens"].tolist() == [[tok.bos_id, 65, 69, 70, pad, pad, pad, pad]]
    assert second["labels"].tolist() == [[ignore, 69, 70] + [ignore] * 5]
    assert first["advantages"].tolist() == [1.0, -1.0] and second["advantages"].tolist() == [0.5]
    assert (first["tokens"].dtype, first["labels"].dtype, first["rollout_logps"].dtype) == (
        torch.long,
        torch.long,
        torch.float32,
    )
    with pytest.raises(ValueError, match="a rollout of 9 tokens is longer than data.seq_length 8"):
        rollout_micro_batches([Long], [Rollout(0, 0, [1, 2, 3, 4], [0.0] * 4, "length")], [0.0], 8, 2, pad)


def test_console_line_shows_reward_and_length():
    record = {"step": 1, "loss": 0.1, "lr": 1e-6, "tokens_per_second": 5.0, "step_time": 1.0}
    line = format_step_line({**record, "reward_mean": 0.5, "response_length_mean": 6.0}, 4, None)
    assert "loss 0.1000 | reward 0.500 len 6.0 | lr 1.000e-06" in line
