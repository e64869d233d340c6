"""Stop strings, ``megacann-generate --chat`` and the command's bad input, on a tiny Hugging Face LLaMA with
the byte tokenizer (whose random output holds multi-byte and invalid UTF-8, what incremental decoding
must get right).

Stop strings are held to a naive reference written here: the first token count whose whole decoded text
holds the stop string, and that text cut before it. The chat reads its turns from stdin: the second turn's
prompt is the first one's, the first answer and the template's turn markers, and the answers are written
while they are generated.
"""

from __future__ import annotations

import dataclasses
import io
import json
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
from megacann.generation.stops import IncrementalText
from megacann.interop import from_pretrained_hf
from megacann.models import get_model_spec

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_id
UNFINISHED = "\ufffd"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_llama(str(tmp_path_factory.mktemp("generate_cli") / "hf"))


@pytest.fixture(scope="module")
def generator(model_dir):
    model = from_pretrained_hf(model_dir).eval()
    return Generator(model, get_model_spec("llama"), eos_token_ids=[EOS], pad_token_id=TOKENIZER.pad_id)


def naive_stop(tokens: list[int], stop: str) -> tuple[int, str]:
    """The fewest tokens whose whole decoded text holds ``stop``, and that text cut before it."""
    for count in range(1, len(tokens) + 1):
        text = TOKENIZER.decode(tokens[:count])
        if stop in text:
            return count, text[: text.index(stop)]
    raise AssertionError(f"{stop!r} is not in the unstopped text")


def stop_from_middle(tokens: list[int]) -> str:
    """Two characters of the unstopped text past its first third (else one), no unfinished character."""
    text = TOKENIZER.decode(tokens)
    for width in (2, 1):
        for at in range(len(text) // 3, len(text) - width + 1):
            if UNFINISHED not in text[at : at + width]:
                return text[at : at + width]
    raise AssertionError(f"no clean pair of characters in {text!r}")


PROMPTS = ["hello", "abc", "a longer prompt here"]


def test_stop_strings_end_each_request_where_its_text_first_holds_one(generator):
    ids = [TOKENIZER.encode(p) for p in PROMPTS]
    free = generator.generate(ids, SamplingParams(max_new_tokens=24))
    stops = [stop_from_middle(r.tokens) for r in free[:2]] + [""]  # the third request has none
    params = [SamplingParams(max_new_tokens=24, stop=(s,) if s else ()) for s in stops]
    checker = StopStrings(TOKENIZER, [p.stop for p in params], skip=[EOS])
    stopped = generator.generate(ids, params, stop_check=checker)
    for request in range(2):
        count, text = naive_stop(free[request].tokens, stops[request])
        assert count < 24  # the request finished early
        assert stopped[request].tokens == free[request].tokens[:count]
        assert stopped[request].logprobs == pytest.approx(free[request].logprobs[:count], abs=1e-6)
        assert stopped[request].finish_reason == "stop"
        assert checker.text(request) == text
    assert stopped[2].tokens == free[2].tokens and stopped[2].finish_reason == "length"
    assert checker.text(2) == TOKENIZER.decode(free[2].tokens)


def test_incremental_text_equals_the_whole_decode_through_split_characters():
    encoded = "aé€b".encode() + bytes([0x80]) + "z日本".encode()  # 2- and 3-byte characters, a stray byte
    text = IncrementalText(TOKENIZER, skip=[EOS])
    seen = []
    for count, byte in enumerate(encoded, 1):
        text.push(byte)
        seen.append(text.text)
        whole = TOKENIZER.decode(encoded[:count])
        assert whole.startswith(text.text) and (whole == text.text or whole.endswith(UNFINISHED))
    text.push(EOS)  # adds no text
    assert text.text == TOKENIZER.decode(encoded) == "aé€b\ufffdz日本"
    assert seen[1] == "a" and seen[2] == "aé"  # é waited for its second byte


def test_streaming_holds_back_what_may_become_a_stop_string():
    stops = StopStrings(TOKENIZER, [("<|im_end|>",)])
    shown = []
    for byte in b"hi <|im_end|> more":
        if stops(0, byte):
            break
        shown.append(stops.stream(0))
    assert "".join(shown) == "hi "
    assert shown[-1] == ""  # "<|im_end|" was held back, not shown
    assert stops.stream(0) + stops.rest(0) == "" and stops.text(0) == "hi "


def test_a_stop_must_be_a_string_or_a_list_of_strings():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["x", "yz"]).stop == ("x", "yz")
    with pytest.raises(
        ValueError, match=r"^sampling option stop must be a string or a list of strings, got 3 \(int\)$"
    ):
        SamplingParams(stop=3)
    with pytest.raises(ValueError, match=r"got \['a', 1\] \(list\)"):
        SamplingParams(stop=["a", 1])
    with pytest.raises(ValueError, match="stop string must not be empty"):
        SamplingParams(stop="")


def test_stop_strings_without_a_checker_are_refused(generator):
    with pytest.raises(ValueError, match="sampling option stop needs the tokenizer"):
        generator.generate([[1, 2]], SamplingParams(max_new_tokens=2, stop="x"))


def _write(path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_the_command_cuts_completions_at_stop_strings_from_lines_and_flags(model_dir, generator, tmp_path, capsys):
    free = generator.generate([TOKENIZER.encode(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=16))
    first, second = (stop_from_middle(r.tokens) for r in free)
    source = _write(tmp_path / "in.jsonl", [{"prompt": PROMPTS[0], "stop": first}, {"prompt": PROMPTS[1]}])
    out = tmp_path / "out.jsonl"
    base = ["--model", model_dir, "--tokenizer", "byte", "--max_new_tokens", "16"]
    assert main([*base, "--input", source, "--output", str(out), "--stop", second, "--stop", "never"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    for record, result, stop in zip(written, free, (first, second)):  # the line's own stop replaces the flags'
        count, text = naive_stop(result.tokens, stop)
        assert record["completion"] == text and record["tokens"] == result.tokens[:count]
        assert record["finish_reason"] == "stop"
    assert main([*base, "--prompt", PROMPTS[1], "--stop", second]) == 0
    assert capsys.readouterr().out == naive_stop(free[1].tokens, second)[1] + "\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_prompt_file_draws_a_progress_bar(model_dir, tmp_path, monkeypatch):
    source = _write(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    monkeypatch.setattr("sys.stderr", Terminal())
    argv = ["--model", model_dir, "--tokenizer", "byte", "--max_new_tokens", "2", "--batch_size", "2"]
    assert main([*argv, "--input", source, "--output", str(tmp_path / "out.jsonl")]) == 0
    last = sys.stderr.getvalue().strip().split("\r")[-1]
    assert last.startswith("megacann-generate | [########################] 100% | 3/3 prompts")


def test_chat_keeps_the_conversation_and_streams_each_answer(model_dir, generator, monkeypatch):
    screen, prompts, shown_while_generating = io.StringIO(), [], []
    generate = Generator.generate

    def watched(self, ids, params, on_token=None, stop_check=None):
        prompts.append(TOKENIZER.decode(ids[0]))

        def show(request, token):
            on_token(request, token)
            shown_while_generating.append(len(screen.getvalue()))

        return generate(self, ids, params, on_token=show, stop_check=stop_check)

    monkeypatch.setattr(Generator, "generate", watched)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand then?\n/exit\nnot read\n"))
    monkeypatch.setattr("sys.stdout", screen)
    argv = ["--model", model_dir, "--tokenizer", "byte", "--chat", "--max_new_tokens", "12", "--system", "Be brief."]
    argv.append("--no_chat_cache")  # each turn runs the whole conversation through generate
    assert main(argv) == 0
    assert len(prompts) == 2  # /exit ended the chat before the last line
    monkeypatch.setattr(Generator, "generate", generate)
    expected = []
    for prompt in prompts:
        (result,) = generator.generate([TOKENIZER.encode(prompt)], SamplingParams(max_new_tokens=12))
        expected.append(TOKENIZER.decode([t for t in result.tokens if t != EOS]))
    first_turn = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompts[0] == first_turn
    assert prompts[1] == (
        first_turn + expected[0] + "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert screen.getvalue() == expected[0] + "\n" + expected[1] + "\n"
    first_answer = shown_while_generating[: len(prompts) and 12]
    assert any(0 < shown < len(expected[0]) for shown in first_answer)  # on screen before the answer ended


def test_chat_ends_at_the_end_of_input_and_cuts_at_the_template_end(model_dir, generator, monkeypatch):
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (free,) = generator.generate([TOKENIZER.encode(prompt)], SamplingParams(max_new_tokens=16))
    end = stop_from_middle(free.tokens)
    monkeypatch.setattr("megacann.data.sft_templates.TEMPLATES", {"chatml": _with_suffix(end)})
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert main(["--model", model_dir, "--tokenizer", "byte", "--chat", "--max_new_tokens", "16"]) == 0
    assert sys.stdout.getvalue() == naive_stop(free.tokens, end)[1] + "\n"


def _with_suffix(suffix: str):
    return dataclasses.replace(TEMPLATES["chatml"], assistant_suffix=suffix)


def test_bad_input_is_one_line_naming_it(model_dir, tmp_path):
    base = ["--model", model_dir, "--tokenizer", "byte"]
    out = ["--output", str(tmp_path / "out.jsonl")]
    not_json = _write(tmp_path / "in.jsonl", [{"prompt": "ok"}, "{not json"])
    with pytest.raises(SystemExit, match=r"^megacann-generate: .*in.jsonl:2: not a JSON object \(Expecting"):
        main([*base, "--input", not_json, *out])
    bad_stop = _write(tmp_path / "in.jsonl", [{"prompt": "ok", "stop": {"a": 1}}])
    with pytest.raises(SystemExit, match=r"in.jsonl:1: sampling option stop must be a string or a list of strings"):
        main([*base, "--input", bad_stop, *out])
    with pytest.raises(SystemExit, match="a prompt of 11 tokens is longer than the cache's max_len 8"):
        main([*base, "--prompt", "eleven char", "--max_len", "8"])
    with pytest.raises(SystemExit, match=r"sampling option top_k must be >= 0 \(0: off\), got -1"):
        main([*base, "--prompt", "x", "--top_k", "-1"])
    with pytest.raises(SystemExit, match="sampling option temperature must be >= 0"):
        main([*base, "--prompt", "x", "--temperature", "-0.5"])
    with pytest.raises(SystemExit, match=r"sampling option top_p must be in \(0, 1\] \(1: off\), got 1.5"):
        main([*base, "--prompt", "x", "--top_p", "1.5"])
    with pytest.raises(SystemExit, match="--template 'nope' is neither a template name"):
        main([*base, "--chat", "--template", "nope"])
    with pytest.raises(SystemExit, match=f"--model: '{tmp_path}' is .*neither a megacann checkpoint"):
        main(["--model", str(tmp_path), "--tokenizer", "byte", "--prompt", "x"])
