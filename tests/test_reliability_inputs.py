"""Bad input is one clear error before training starts, naming the file, key or path and the fix: each case
once, through megacann-train's entry point (in this process, which is cheap; the console script itself is
exercised by the other reliability and install tests)."""

import json
import re
import shutil

import pytest
from reliability_helpers import TEXT, write_corpus, write_recipe

from megacann.cli import train_main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _fail(capsys, recipe, *overrides, resume=None) -> str:
    """megacann-train's one-line error (exit code 2) for ``recipe`` with ``overrides``."""
    args = ["--config", str(recipe), *overrides] + (["--resume_from", resume] if resume else [])
    code = train_main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("megacann-train: error: "), err
    return err


def test_recipe_errors(tmp_path, capsys, corpus):
    recipe = write_recipe(tmp_path, corpus)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  hidden_size: 32\n  num_layers: [2\n")
    err = _fail(capsys, broken)
    assert f"{broken}: not valid YAML" in err and "line 4" in err  # the line where the list is left open
    assert "did you mean 'optim.lr'" in _fail(capsys, recipe, "optim.learning_rat=1e-3")
    assert "data.batch_size: expected int, got 'two'" in _fail(capsys, recipe, "data.batch_size=two")
    err = _fail(capsys, recipe, "distributed.tensor_parallel_size=3")
    assert "model.num_attention_heads 4 is not divisible by distributed.tensor_parallel_size 3" in err
    err = _fail(capsys, recipe, "data.seq_length=64")
    assert "data.seq_length 64 exceeds model.max_position_embeddings 32" in err
    assert "shorten data.seq_length or raise model.max_position_embeddings" in err


def test_data_errors(tmp_path, capsys, corpus):
    recipe = write_recipe(tmp_path, corpus)
    err = _fail(capsys, recipe, f"data.path={tmp_path / 'nowhere'}")
    assert f"data.path: '{tmp_path / 'nowhere'}' is not a .bin/.idx pair" in err
    (tmp_path / "empty").mkdir()
    err = _fail(capsys, recipe, f"data.path={tmp_path / 'empty'}")
    assert f"data.path: directory '{tmp_path / 'empty'}' holds no .bin/.idx pairs" in err

    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(f"{corpus}.bin", bad / "corpus.bin")
    (bad / "corpus.idx").write_bytes(b"not an index at all, just some bytes of something else")
    err = _fail(capsys, recipe, f"data.path={bad / 'corpus'}")
    assert f"{bad / 'corpus.idx'}: not a Megatron indexed dataset index" in err
    assert "write it again with megacann-preprocess" in err

    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(f"{corpus}.idx", cut / "corpus.idx")
    (cut / "corpus.bin").write_bytes(open(f"{corpus}.bin", "rb").read()[:100])  # noqa: SIM115
    err = _fail(capsys, recipe, f"data.path={cut / 'corpus'}")
    assert f"{cut / 'corpus.bin'}: 100 bytes but the index" in err and "truncated .bin" in err


def test_tokenizer_output_dir_and_resume_errors(tmp_path, capsys, corpus):
    recipe = write_recipe(tmp_path, corpus)
    err = _fail(capsys, recipe, "model.vocab_size=100")
    assert "data.tokenizer has 259 tokens but model.vocab_size is 100" in err
    assert "Set model.vocab_size >= 259" in err

    (tmp_path / "a_file").write_text("x")
    err = _fail(capsys, recipe, f"experiment.output_dir={tmp_path / 'a_file' / 'run'}")
    assert (
        f"experiment.output_dir '{tmp_path / 'a_file' / 'run'}' cannot be used: {tmp_path / 'a_file'} is a file" in err
    )

    half = tmp_path / "run" / "checkpoint_3"
    half.mkdir(parents=True)
    err = _fail(capsys, recipe, resume=str(half))
    assert f"--resume_from '{half}': checkpoint is incomplete" in err and "its save was interrupted" in err
    err = _fail(capsys, recipe, resume="latest")
    assert "no complete checkpoint in" in err and "drop --resume_from to start from step 0" in err


def test_checkpoint_of_another_model_and_sft_lines(tmp_path, capsys, corpus):
    recipe = write_recipe(tmp_path, corpus, optim={"max_steps": 1})
    assert train_main(["--config", str(recipe)]) == 0  # a checkpoint at step 1 of this small model
    capsys.readouterr()
    err = _fail(capsys, recipe, "model.hidden_size=64", "optim.max_steps=2")
    assert f"{tmp_path / 'run' / 'checkpoint_1'} holds another model: hidden_size 32 (recipe: 64)" in err
    assert "Resume it with the recipe it was saved with" in err

    sft = tmp_path / "sft.jsonl"
    good = json.dumps({"instruction": "add", "output": TEXT})
    sft.write_text(f"{good}\n{{not json\n{good}\n")
    sft_args = ["train_mode=sft", f"data.path={sft}", f"experiment.output_dir={tmp_path / 'sft'}"]
    sft_args += ["data.seq_length=256", "model.max_position_embeddings=256"]  # room for the prompt template
    err = _fail(capsys, recipe, *sft_args)
    assert f"{sft}:2: malformed SFT record" in err and "set data.skip_bad_lines: true" in err
    assert train_main(["--config", str(recipe), *sft_args, "data.skip_bad_lines=true", "data.split=100,0,0"]) == 0
    err = capsys.readouterr().err
    assert "2 samples from 3 lines; 1 bad lines skipped" in err and f"{sft}:2: malformed SFT record" in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.max_skipped_steps=0", "training.max_skipped_steps must be >= 1, got 0"),
        ("training.hang_factor=1", "training.hang_factor must be 0 (off) or a multiple above 1, got 1.0"),
        ("training.skip_loss_spikes=true", "training.skip_loss_spikes needs training.loss_spike_factor"),
        ("logging.keep_last=0", "logging.keep_last must be >= 1, got 0"),
        ("optim.adam_beta2=1.5", "optim.adam_beta2 must be in [0, 1), got 1.5"),
        ("optim.lr=.nan", "optim.lr: expected a finite number, got nan"),
    ],
)
def test_values_out_of_range_are_refused(override, message):
    from training_helpers import tiny_config

    from megacann.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config([override])
