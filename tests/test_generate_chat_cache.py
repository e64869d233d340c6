"""A chat's cache kept across turns (:class:`~megacann.generation.chat.ChatSession` with ``cache_len``) with the
byte tokenizer: over three turns each answer's tokens and log-probabilities equal a run from scratch of the
conversation's tokens so far; the second and third turns' first forwards run only the new tokens (the last
answer's last token, then the template's text after the answer) after a cache holding everything before
them. So for every kind of cache, each on a tiny Hugging Face model: keys and values (LLaMA), rolling windows
(Mistral; gpt-oss with sinks), latent caches (DeepSeek-V3; V3.2 with its indexer's keys), Gated DeltaNet's
recurrent state (Qwen3.5, Qwen3-Next) and DeepSeek-V4's window with compressor projections, its turns
starting with compressed windows left partial (extended tier). Where the cache would overflow, one
line says so and the turn runs the whole conversation, as does a turn after an answer cut at a stop string of
the user's (the rendered text no longer continues the cached one); a cache layer that does not take several
tokens after cached ones is not extended; and ``megacann-generate --chat`` keeps the cache by default."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from deepseek_helpers import tiny_hf_deepseek
from deepseek_v4_helpers import tiny_hf_v4
from generation_helpers import (
    VOCAB,
    one_thread,  # noqa: F401 (an autouse fixture)
    tiny_hf_llama,
)
from gpt_oss_helpers import tiny_hf_gpt_oss
from qwen3_5_helpers import tiny_hf_qwen3_5
from qwen3_next_helpers import tiny_hf_qwen3_next
from test_deepseek_v32_models import tiny_hf_deepseek_v32
from test_mistral import tiny_hf_mistral

from megacann.data.sft_templates import TEMPLATES
from megacann.data.tokenizer import ByteTokenizer
from megacann.generate import main
from megacann.generation import Generator, SamplingParams, StopStrings
from megacann.generation.chat import ChatSession
from megacann.generation.kv_cache import CacheLayer
from megacann.generation.latent_cache import LatentCacheLayer
from megacann.generation.recurrent_cache import RecurrentCacheLayer
from megacann.interop import from_pretrained_hf
from megacann.layers import SelfAttention
from megacann.models import get_model_spec

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_id
TURNS = ["hello there", "and then?", "say more"]
PARAMS = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_llama(str(tmp_path_factory.mktemp("chat_cache") / "hf"))


def _generator(model_dir: str, family: str = "llama") -> Generator:
    model = from_pretrained_hf(model_dir).eval()
    return Generator(model, get_model_spec(family), eos_token_ids=[EOS], pad_token_id=TOKENIZER.pad_id)


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


def _rolling(cache) -> bool:  # a sliding window shorter than the conversation: a rolling cache
    return any(getattr(layer, "rolling", False) or getattr(getattr(layer, "local", None), "rolling", False)
               for layer in cache.layers)  # fmt: skip


# each kind of cache (beyond plain keys and values): its family, a tiny Hugging Face model of it with room for
# the conversation's positions, and a probe that the cache kept is of that kind
LONG = {"max_position_embeddings": 512}
KINDS = {
    "llama": ("llama", lambda path: tiny_hf_llama(path, **LONG), lambda cache: not _rolling(cache)),
    "rolling_window": (
        "mistral",
        lambda path: tiny_hf_mistral(path, vocab_size=VOCAB, **LONG),
        _rolling,
    ),
    "rolling_window_sinks": ("gpt_oss", tiny_hf_gpt_oss, _rolling),
    "latent": (
        "deepseek_v3",
        lambda path: tiny_hf_deepseek(path, "yarn", **LONG),
        lambda cache: all(isinstance(layer, LatentCacheLayer) and layer.index_keys is None for layer in cache.layers),
    ),
    "latent_sparse": (
        "deepseek_v32",
        lambda path: tiny_hf_deepseek_v32(path, **LONG),
        lambda cache: all(layer.index_keys is not None for layer in cache.layers),
    ),
    "recurrent": (
        "qwen3_5",
        lambda path: tiny_hf_qwen3_5(path, std=0.05, **LONG),
        lambda cache: sum(isinstance(layer, RecurrentCacheLayer) for layer in cache.layers) == 3,
    ),
    "recurrent_moe": (
        "qwen3_next",
        lambda path: tiny_hf_qwen3_next(path, **LONG),
        lambda cache: sum(isinstance(layer, RecurrentCacheLayer) for layer in cache.layers) == 3,
    ),
    "compressed_window": (
        "deepseek_v4",
        tiny_hf_v4,
        lambda cache: _rolling(cache) and sum(layer.history is not None for layer in cache.layers) == 3,
    ),
}


# indexers whose scores tie (every head's ReLU off gives 0): torch's top-k breaks ties by how many entries it
# ranks, which differs between an answer's token decoded (the kept cache) and the same token in a prefill (the
# run from scratch); both runs break them by position here, so the comparison sees the cache alone
SPARSE = {"latent_sparse", "compressed_window"}


def _topk_ties_by_position(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    values, indices = scores.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


# DeepSeek-V4's tiny model takes 6.4 s for the three turns and their runs from scratch (the others 0.2-1.2 s;
# measured on 2 cores at load 4, ~8 s and up to 5 s at load 8): extended tier
SLOW = {"compressed_window"}


@pytest.mark.parametrize(
    "kind", [pytest.param(kind, marks=[pytest.mark.extended] if kind in SLOW else []) for kind in sorted(KINDS)]
)
def test_each_turn_runs_only_its_new_tokens_and_equals_the_conversation_from_scratch(kind, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    family, write, probe = KINDS[kind]
    if kind in SPARSE:
        monkeypatch.setattr(torch.Tensor, "topk", _topk_ties_by_position)
    generator = _generator(write(str(tmp_path / "hf")), family)
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
    assert probe(session.cache)
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
        if kind == "compressed_window":  # the cached tokens left windows of both compression rates (4, 8) open
            assert call["cached"] % 4 and call["cached"] % 8


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


def test_an_answer_cut_at_a_stop_string_of_its_own_runs_the_next_turn_whole(model_dir, monkeypatch):
    generator = _generator(model_dir)
    recorded, notices = Recorded(generator, monkeypatch), []
    probe = ChatSession(generator, TOKENIZER, TEMPLATES["chatml"], PARAMS, cache_len=512)
    probe.reply(TURNS[0], io.StringIO())
    answer = TOKENIZER.decode(recorded.calls[0]["result"].tokens)
    stop = next(ch for ch in answer[1:] if ch.isprintable() and ch not in "<|im_end>\ufffd")  # not the suffix's
    params = SamplingParams(max_new_tokens=12, stop=(stop,))
    session = ChatSession(generator, TOKENIZER, TEMPLATES["chatml"], params, cache_len=512, notice=notices.append)
    session.reply(TURNS[0], io.StringIO())
    assert recorded.calls[-1]["result"].finish_reason == "stop"
    screen = io.StringIO()
    session.reply(TURNS[1], screen)
    assert notices == ["the conversation no longer continues the cached tokens: this turn runs it whole"]
    assert recorded.calls[-1]["cached"] == 0 and recorded.calls[-1]["fed"] == TOKENIZER.encode(session.prompts[1])
    stops = StopStrings(TOKENIZER, [session.params.stop], skip=[EOS])
    Generator.generate(generator, [TOKENIZER.encode(session.prompts[1])], session.params, stop_check=stops)
    assert screen.getvalue() == stops.text(0) + "\n"


def test_extend_refuses_a_cache_it_would_overflow_and_one_whose_layers_do_not_take_several_tokens(
    model_dir, monkeypatch
):
    generator = _generator(model_dir)
    cache = generator.new_cache(8)
    assert cache.extendable
    with pytest.raises(ValueError, match=r"^extending a cache of 0 tokens by 5 .* max_new_tokens 12 needs 16 slots"):
        generator.extend(cache, [1, 2, 3, 4, 5], PARAMS)
    for attention in generator.model.modules():
        if isinstance(attention, SelfAttention):
            attention.sliding_window = 6  # a rolling cache: its queries read the window as held, then the new tokens
    assert generator.new_cache(40).layers[0].rolling and generator.new_cache(40).extendable
    # a cache layer that does not say it takes several tokens after cached ones (a custom one registered
    # without ``extendable``) is refused by extend, and the chat runs each turn whole
    monkeypatch.delattr(CacheLayer, "extendable")
    assert not generator.new_cache(40).extendable
    with pytest.raises(ValueError, match="^extend needs one micro-batch and a one-row cache whose layers take"):
        generator.extend(generator.new_cache(40), [1, 2], PARAMS)
    notices = []
    session = ChatSession(generator, TOKENIZER, TEMPLATES["chatml"], PARAMS, cache_len=40, notice=notices.append)
    assert session.cache_len is None
    assert notices == ["the model's cache cannot be kept across turns: each turn runs the whole conversation"]
