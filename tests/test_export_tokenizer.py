"""The run's tokenizer travels with its weights: kept in every checkpoint, exported by ``megacann-convert
to-hf`` so that the README's transformers snippet (AutoTokenizer + AutoModelForCausalLM + generate) runs on
the export as it is and generates what megacann's own model generates."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import ROOT, console_script, user_env
from dist_harness import run_on_ranks

from megacann.convert import main as convert

TRAIN = [
    "--config",
    "examples/configs/llama/tiny.yaml",  # the default corpus and its BPE, as the README's quick start
    "optim.max_steps=2",
    "logging.log_interval=1",
    "logging.eval_interval=0",
    "data.batch_size=2",
    "data.num_workers=0",
    "model.num_layers=2",
]


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=user_env(), timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def _train_main_in(cwd: str, argv: list[str]) -> int:
    """``megacann-train``'s entry point in a process of its own, forked from the test harness's server
    (torch and megacann already imported: no fresh interpreter to start)."""
    os.chdir(cwd)
    from megacann.cli import train_main

    return train_main(argv)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny run trained through ``megacann-train``'s entry point (one rank); its output directory."""
    out = tmp_path_factory.mktemp("tokenizer_export") / "run"
    argv = [*TRAIN, f"experiment.output_dir={out}"]
    assert run_on_ranks(_train_main_in, 1, args=(ROOT, argv), timeout=600, init_process_group=False) == [0]
    return out


def _readme_snippet() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return next(block.split("```", 1)[0] for block in text.split("```python\n")[1:] if "AutoModelForCausalLM" in block)


def test_every_checkpoint_keeps_the_run_tokenizer(run_dir):
    from megacann.data.default_corpus import corpus_dir

    checkpoint = run_dir / "checkpoint_2"
    record = json.loads((checkpoint / "megacann.json").read_text())["tokenizer"]
    source = os.path.join(corpus_dir(), "tokenizer-v8192")  # the default BPE, from the cache
    assert record == {
        "kind": "hf",
        "source": source,
        "vocab_size": 8192,
        "bos_id": None,
        "eos_id": 0,
        "pad_id": 1,
        "fingerprint": record["fingerprint"],
        "directory": "tokenizer",
    }
    kept = checkpoint / "tokenizer"
    assert (kept / "tokenizer.json").read_bytes() == Path(source, "tokenizer.json").read_bytes()
    config = json.loads((kept / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"], config["model_max_length"]) == ("<|endoftext|>", "<|pad|>", 256)


@pytest.mark.extended
def test_readme_snippet_loads_the_export_and_generates_what_megacann_generates(run_dir, tmp_path):
    from megacann.data.tokenizer import load_tokenizer
    from megacann.interop.full_state import load_full_state_dict_
    from megacann.interop.reading import read_checkpoint_weights
    from megacann.layers import LayerContext
    from megacann.models import LlamaModel

    hf_dir = tmp_path / "hf"
    old_mask = os.umask(0o022)
    try:
        proc = _run([console_script("megacann-convert"), "to-hf", str(run_dir), str(hf_dir)])
    finally:
        os.umask(old_mask)
    assert f"tokenizer: {run_dir}/checkpoint_2/tokenizer" in proc.stdout
    files = sorted(p.name for p in hf_dir.iterdir())
    expected = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert files == expected
    for name in files:  # ordinary permissions: what any new file gets under umask 022
        assert stat.S_IMODE((hf_dir / name).stat().st_mode) == 0o644, name
    assert json.loads((hf_dir / "generation_config.json").read_text()) == {
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 1,
    }
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == 0

    snippet = _readme_snippet().replace('"out/hf"', repr(str(hf_dir)))
    script = snippet + "import json; print('IDS', json.dumps([inputs['input_ids'][0].tolist(), out[0].tolist()]))\n"
    printed, ids = _run([sys.executable, "-c", script], timeout=300).stdout.rsplit("IDS ", 1)
    prompt_ids, generated = json.loads(ids)

    # the same prompt, tokenizer and greedy decoding with megacann's own model and tokenizer
    tokenizer = load_tokenizer(str(run_dir / "checkpoint_2" / "tokenizer"))
    prompt = "def main():\n    "
    assert repr(prompt).replace("'", '"') in snippet and prompt_ids == tokenizer.encode(prompt)
    weights, cfg = read_checkpoint_weights(str(run_dir / "checkpoint_2"))
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    model = LlamaModel(cfg, context=LayerContext(params_dtype=torch.float32)).eval()
    load_full_state_dict_([model], {k: v.float() for k, v in weights.items()})
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        while ids.shape[1] < len(generated) and ids[0, -1].item() != tokenizer.eos_id:
            ids = torch.cat([ids, model(input_ids=ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0].tolist() == generated
    assert len(generated) == len(prompt_ids) + 20 or generated[-1] == tokenizer.eos_id
    assert printed.splitlines() == tokenizer.decode(generated).splitlines()  # the snippet's text (\r read as \n)


def test_consolidated_directory_carries_the_tokenizer_to_hf(run_dir, tmp_path, capsys):
    whole, hf_dir = tmp_path / "whole", tmp_path / "hf"
    assert convert(["consolidate", str(run_dir), str(whole)]) == 0
    assert convert(["to-hf", str(whole), str(hf_dir)]) == 0
    assert f"tokenizer: {whole}/tokenizer" in capsys.readouterr().out
    kept = run_dir / "checkpoint_2" / "tokenizer" / "tokenizer.json"
    assert (hf_dir / "tokenizer.json").read_bytes() == kept.read_bytes()
    back = tmp_path / "back"
    assert convert(["from-hf", str(hf_dir), str(back)]) == 0  # and the import keeps it
    assert (back / "tokenizer" / "tokenizer.json").read_bytes() == kept.read_bytes()


def test_a_checkpoint_without_its_copy_falls_back_to_its_recipe(run_dir, tmp_path, capsys):
    """Checkpoints written before the copy existed: the recipe's tokenizer if it is still there, else
    the weights alone, saying why."""
    old = tmp_path / "checkpoint_2"
    shutil.copytree(run_dir / "checkpoint_2", old)
    shutil.rmtree(old / "tokenizer")
    info = json.loads((old / "megacann.json").read_text())
    del info["tokenizer"]
    (old / "megacann.json").write_text(json.dumps(info))
    assert convert(["to-hf", str(old), str(tmp_path / "hf")]) == 0
    assert "tokenizer: the default BPE (8192 tokens) its recipe used (the checkpoint holds no copy)" in (
        capsys.readouterr().out
    )
    assert (tmp_path / "hf" / "tokenizer.json").is_file()

    recipe = (old / "config.yaml").read_text()
    (old / "config.yaml").write_text(recipe.replace("cache_dir: null", f"cache_dir: {tmp_path / 'empty'}"))
    assert convert(["to-hf", str(old), str(tmp_path / "hf2")]) == 0
    out = capsys.readouterr().out
    assert f"no tokenizer to export: {old} holds no tokenizer/ and the default BPE (8192 tokens)" in out
    assert "is no longer cached at" in out
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == ["config.json", "model.safetensors"]

    (old / "config.yaml").write_text(recipe)  # the cached BPE again, but a model of fewer rows than it has
    info["model"]["vocab_size"] = 300
    (old / "megacann.json").write_text(json.dumps(info))
    assert convert(["to-hf", str(old), str(tmp_path / "hf3")]) == 0
    assert "has 8192 tokens, more than the model's vocab_size 300: the run tokenized its data otherwise" in (
        capsys.readouterr().out
    )
    assert not (tmp_path / "hf3" / "tokenizer.json").exists()


def test_a_tokenizer_larger_than_the_model_is_refused(run_dir, tmp_path, capsys):
    wrong = tmp_path / "checkpoint_2"
    shutil.copytree(run_dir / "checkpoint_2", wrong)
    info = json.loads((wrong / "megacann.json").read_text())
    info["model"]["vocab_size"] = 300
    (wrong / "megacann.json").write_text(json.dumps(info))
    assert convert(["to-hf", str(wrong), str(tmp_path / "hf")]) == 1
    assert "has 8192 tokens, more than the model's vocab_size 300" in capsys.readouterr().err


TEXTS = ["def forward(self, x):\n    return x", "héllo wörld 日本語", "tabs\tand\nlines"]


def test_byte_tokenizer_exports_as_an_equal_tokenizer_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megacann.data.tokenizer import ByteTokenizer, load_tokenizer
    from megacann.data.tokenizer_files import save_tokenizer

    byte = ByteTokenizer()
    save_tokenizer(byte, str(tmp_path), model_max_length=64)
    ours, theirs = load_tokenizer(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == byte.encode(text) == theirs(text).input_ids
        assert theirs.decode(byte.encode(text)) == text
    assert (ours.eos_id, ours.bos_id, ours.pad_id, ours.vocab_size) == (256, 257, 258, 259)
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id) == (256, 257, 258)


def test_sentencepiece_tokenizer_exports_as_its_model_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    spm = pytest.importorskip("sentencepiece")
    from megacann.data.tokenizer import load_tokenizer
    from megacann.data.tokenizer_files import save_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(p.read_text() for p in sorted(Path(ROOT, "megacann", "layers").glob("*.py"))))
    spm.SentencePieceTrainer.train(  # LLaMA-style: no normalisation, bytes for what the vocabulary lacks
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=400,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        normalization_rule_name="identity",
        byte_fallback=True,
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = load_tokenizer(str(tmp_path / "sp.model"))
    out = tmp_path / "export"
    save_tokenizer(sp, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert theirs(text, add_special_tokens=False).input_ids == sp.encode(text), text
        assert theirs.decode(sp.encode(text)) == sp.decode(sp.encode(text))
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 3)
