"""``megacann-generate`` on a tiny Hugging Face LLaMA with the byte tokenizer: ``--prompt`` prints the
generator's completion, from the Hugging Face directory and from its consolidated megacann copy; ``--input/--output`` writes one line per prompt, in order, each with the tokens,
log-probabilities and finish reason of the generator run with that line's own sampling options; an
interrupted run has its finished batches on disk at the moment it stops; bad input is one line naming the file, line or option."""

from __future__ import annotations

import json

import pytest
from generation_helpers import (
    one_thread,  # noqa: F401 (an autouse fixture)
    tiny_hf_llama,
)

from megacann.data.tokenizer import ByteTokenizer
from megacann.generate import main
from megacann.generation import Generator, SamplingParams
from megacann.interop import from_pretrained_hf
from megacann.interop.export import import_hf
from megacann.models import get_model_spec

TOKENIZER = ByteTokenizer()
EOS = (TOKENIZER.eos_id,)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_llama(str(tmp_path_factory.mktemp("generate") / "hf"))


def _expected(model_dir: str, prompts: list[str], params: list[SamplingParams]):
    model = from_pretrained_hf(model_dir).eval()
    generator = Generator(model, get_model_spec("llama"), eos_token_ids=EOS, pad_token_id=TOKENIZER.pad_id)
    return generator.generate([TOKENIZER.encode(p) for p in prompts], params)


def test_one_prompt_prints_its_completion_from_any_weights_directory(model_dir, tmp_path, capsys):
    (result,) = _expected(model_dir, ["abc"], [SamplingParams(max_new_tokens=12)])
    completion = TOKENIZER.decode([t for t in result.tokens if t not in EOS])
    consolidated = import_hf(model_dir, str(tmp_path / "whole"), log=lambda line: None)
    for source in (model_dir, consolidated):
        assert main(["--model", source, "--tokenizer", "byte", "--prompt", "abc", "--max_new_tokens", "12"]) == 0
        assert capsys.readouterr().out == completion + "\n", source


def _write_prompts(path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_a_prompt_file_gives_one_line_per_prompt_with_its_own_options(model_dir, tmp_path):
    lines = [
        {"prompt": "hello"},
        {"prompt": "a longer prompt here", "temperature": 0.8, "top_k": 30, "seed": 4},
        {"prompt": "xy", "max_new_tokens": 3},
    ]
    source, out = _write_prompts(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    argv = ["--model", model_dir, "--tokenizer", "byte", "--input", source, "--output", str(out)]
    assert main([*argv, "--max_new_tokens", "10", "--batch_size", "2", "--seed", "100"]) == 0
    params = [
        SamplingParams(max_new_tokens=10, seed=101),
        SamplingParams(max_new_tokens=10, temperature=0.8, top_k=30, seed=4),
        SamplingParams(max_new_tokens=3, seed=103),
    ]
    expected = _expected(model_dir, [line["prompt"] for line in lines], params)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == [line["prompt"] for line in lines]
    for record, result in zip(written, expected):
        assert record["tokens"] == result.tokens
        assert record["logprobs"] == pytest.approx(result.logprobs, abs=1e-6)
        assert record["finish_reason"] == result.finish_reason
        assert record["completion"] == TOKENIZER.decode([t for t in result.tokens if t not in EOS])
    assert written[2]["finish_reason"] == "length" and len(written[2]["tokens"]) == 3


def test_an_interrupted_run_keeps_the_batches_it_finished(model_dir, tmp_path, monkeypatch):
    source = _write_prompts(tmp_path / "in.jsonl", [{"prompt": "one"}, {"prompt": "two"}, {"prompt": "three"}])
    out = tmp_path / "out.jsonl"
    calls, on_disk = [], []
    generate = Generator.generate

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # a kill now: what the file holds is what survives
            on_disk.append(out.read_text())
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Generator, "generate", interrupted)
    argv = ["--model", model_dir, "--tokenizer", "byte", "--input", source, "--output", str(out), "--batch_size", "1"]
    with pytest.raises(KeyboardInterrupt):
        main([*argv, "--max_new_tokens", "4"])
    (line,) = on_disk[0].splitlines()
    assert json.loads(line)["prompt"] == "one"
    assert out.read_text() == on_disk[0]


def test_bad_input_is_one_line_naming_it(model_dir, tmp_path, capsys):
    base = ["--model", model_dir, "--tokenizer", "byte"]
    source = _write_prompts(tmp_path / "in.jsonl", [{"prompt": "ok"}, {"prompt": "hot", "temperature": -1}])
    with pytest.raises(SystemExit, match=r"in.jsonl:2: sampling option temperature must be >= 0"):
        main([*base, "--input", source, "--output", str(tmp_path / "out.jsonl")])
    not_prompts = _write_prompts(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit, match=r'in.jsonl:1: expected an object with a "prompt" string'):
        main([*base, "--input", not_prompts, "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()  # nothing written before every line is checked
    with pytest.raises(SystemExit, match="sampling option top_p must be in"):
        main([*base, "--prompt", "x", "--top_p", "0"])
    with pytest.raises(SystemExit, match=f"--model: '{tmp_path}' is .*neither a megacann checkpoint"):
        main(["--model", str(tmp_path), "--tokenizer", "byte", "--prompt", "x"])
    with pytest.raises(SystemExit):
        main([*base, "--input", source])
    assert "--input needs --output" in capsys.readouterr().err
