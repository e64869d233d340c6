"""A chat's cache kept across turns (:class:`~megacann.generation.chat.ChatSession` with ``cache_len``), on a
tiny Hugging Face LLaMA with the byte tokenizer: over three turns each answer's tokens and log-probabilities
equal a run from scratch of the conversation's tokens so far; the second and third turns' first forwards
run only the new tokens (the last answer's last token, then the template's text after the answer) after
a cache holding everything before them; where the cache would overflow, one line says so and the turn
runs the whole conversation; and ``megacann-generate --chat`` keeps the cache by default."""

from __future__ import annotations

import io
import sys

import pytest
from generation_helpers import (
    one_thread,  # noqa: F401 (an autouse fixture)
    tiny_hf_llama,
)

from megacann.data.sft_templates import TEMPLATES
from megacann.data.tokenizer import ByteTokenizer
from megacann.generate import main
from megacann.generation import Generator, SamplingParams, StopStrings
from megacann.generation.chat import ChatSession
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_id
TURNS = ["hello there", "and then?", "say more"]
PARAMS = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_llama(str(tmp_path_factory.mktemp("chat_cache") / "hf"))


def _generator(model_dir: str) -> Generator:
    model = from_pretrained_hf(model_dir).eval()
    return Generator(model, get_model_spec("llama"), eos_token_ids=[EOS], pad_token_id=TOKENIZER.pad_id)


class Recorded:
    """A generator's ``extend`` calls (the cache's length before, the tokens fed, the result) and the
    number of tokens of each forward."""

    def __init__(self, generator: Generator, monkeypatch):
        self.calls, self.forwards = [], []
        extend, forward = generator.extend, generator.stages.forward

        def recorded_extend(cache, tokens, params, on_token=None, stop_check=None):
            self.calls.append({"cached": cache.length, "fed": list(tokens), "first_forward": len(self.forwards)})
            self.calls[-1]["result"] = extend(cache, tokens, params, on_token, stop_check)
            return self.calls[-1]["result"]

        def recorded_forward(inputs, positions):
            self.forwards.append(inputs.shape[1])
            return forward(inputs, positions)

        monkeypatch.setattr(generator, "extend", recorded_extend)
        monkeypatch.setattr(generator.stages, "forward", recorded_forward)


def _from_scratch(generator: Generator, session: ChatSession, tokens: list[int]):
    stops = StopStrings(TOKENIZER, [session.params.stop], skip=[EOS])
    (result,) = Generator.generate(generator, [tokens], session.params, stop_check=stops)
    return result


def test_each_turn_runs_only_its_new_tokens_and_equals_the_conversation_from_scratch(model_dir, monkeypatch):
    generator = _generator(model_dir)
    recorded = Recorded(generator, monkeypatch)
    session = ChatSession(generator, TOKENIZER, TEMPLATES["chatml"], PARAMS, system="Be brief.", cache_len=512)
    conversation = []  # the conversation's tokens at the start of each turn
    for turn in TURNS:
        before = list(session.tokens)
        session.reply(turn, io.StringIO())
        result = recorded.calls[-1]["result"]
        conversation.append(session.tokens[: len(session.tokens) - len(result.tokens)])
        if before:
            assert conversation[-1][: len(before)] == before  # the new turn continues the kept tokens
    assert len(recorded.calls) == 3 and [call["cached"] for call in recorded.calls][0] == 0
    for turn, call in enumerate(recorded.calls):
        expected = _from_scratch(generator, session, conversation[turn])
        assert call["result"].tokens == expected.tokens and len(expected.tokens) > 0
        assert call["result"].logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        if turn == 0:
            assert call["fed"] == TOKENIZER.encode(session.prompts[0])
            continue
        previous = recorded.calls[turn - 1]
        held = len(conversation[turn - 1]) + len(previous["result"].tokens) - 1  # all but the last one chosen
        assert call["cached"] == held and call["fed"][0] == previous["result"].tokens[-1]
        assert conversation[turn] == conversation[turn - 1] + previous["result"].tokens + call["fed"][1:]
        new_text = TOKENIZER.decode(call["fed"][1:])  # the template's text after the answer, only
        assert session.prompts[turn].endswith(new_text) and new_text.endswith("<|im_start|>assistant\n")
        assert TURNS[turn] in new_text and TURNS[turn - 1] not in new_text
        assert recorded.forwards[call["first_forward"]] == len(call["fed"]) < len(conversation[turn])


def test_a_cache_that_would_overflow_is_said_and_the_turn_runs_the_whole_conversation(model_dir, monkeypatch):
    generator = _generator(model_dir)
    recorded, notices = Recorded(generator, monkeypatch), []
    first_prompt = TEMPLATES["chatml"].render([{"role": "user", "content": TURNS[0]}])[0][0]
    room = len(first_prompt) + PARAMS.max_new_tokens + 4  # turn 1 fits, turn 2 does not
    session = ChatSession(generator, TOKENIZER, TEMPLATES["chatml"], PARAMS, cache_len=room, notice=notices.append)
    screen = io.StringIO()
    session.reply(TURNS[0], screen)
    session.reply(TURNS[1], screen)
    assert len(recorded.calls) == 1 and len(notices) == 1  # the second turn did not extend the cache
    assert notices[0].endswith(f"outgrows the chat cache of {room} tokens: this turn runs the whole conversation")
    whole = TOKENIZER.encode(session.prompts[1])  # the conversation re-rendered and encoded whole
    expected = TOKENIZER.decode([t for t in _from_scratch(generator, session, whole).tokens if t != EOS])
    assert screen.getvalue().split("\n", 1)[1] == expected.split("<|im_end|>")[0] + "\n"


def test_the_command_keeps_the_chat_cache_by_default(model_dir, monkeypatch):
    lengths = []
    extend = Generator.extend

    def recorded(self, cache, tokens, params, on_token=None, stop_check=None):
        lengths.append((cache.length, cache.max_len))
        return extend(self, cache, tokens, params, on_token, stop_check)

    monkeypatch.setattr(Generator, "extend", recorded)
    argv = ["--model", model_dir, "--tokenizer", "byte", "--chat", "--max_new_tokens", "12"]
    monkeypatch.setattr("sys.stdin", io.StringIO(TURNS[0] + "\n"))
    assert main(argv) == 0
    assert lengths == [(0, 128)]  # by default the cache holds the model's max_position_embeddings
    lengths.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(turn + "\n" for turn in TURNS)))
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert main([*argv, "--max_len", "400"]) == 0
    shown = sys.stdout.getvalue()
    assert len(lengths) == 3 and lengths[0] == (0, 400) and 0 < lengths[1][0] < lengths[2][0]
    generator = _generator(model_dir)
    session = ChatSession(generator, TOKENIZER, TEMPLATES["chatml"], PARAMS, cache_len=400)
    screen = io.StringIO()
    for turn in TURNS:
        session.reply(turn, screen)
    assert shown == screen.getvalue()
