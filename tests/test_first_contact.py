"""A new user's first contact, as the README tells it: the two quick-start commands, the test command's
visible summary, a synonym typo, the preprocessing example as written and its tokenizer hint, and the
progress bar of long data jobs."""

import io
import os
import re
import shlex
import subprocess
import sys

import pytest
from cli_helpers import ROOT, console_script, user_env

from megacann.cli import train_main
from megacann.data.progress import ProgressBar


def _readme_block(heading: str) -> list[str]:
    """The command lines of the first bash block after ``heading`` in README.md (comments dropped)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_quick_start_is_two_make_commands_and_ci_runs_the_same_test_command():
    assert _readme_block("## Quick start") == ["make train", "make test"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert "make --no-print-directory test" in ci
    dry = subprocess.run(["make", "-n", "--no-print-directory", "test"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1] == ".venv/bin/python -m pytest tests"
    dry = subprocess.run(["make", "-n", "--no-print-directory", "train"], cwd=ROOT, capture_output=True, text=True)
    assert (
        dry.stdout.strip()
        .splitlines()[-1]
        .endswith("bash scripts/run_pretrain.sh --config examples/configs/llama/tiny.yaml")
    )


@pytest.mark.extended
def test_the_test_command_ends_with_a_visible_summary():
    """pyproject's addopts already say -q: the README's command must not add another (-qq hides the count)."""
    command = shlex.split(_readme_block("## Set-up by hand")[-1])
    assert command == ["python", "-m", "pytest", "tests"]
    node = "tests/test_plot_loss.py::test_smoothing_is_a_bias_corrected_moving_average"
    proc = subprocess.run(
        [sys.executable, *command[1:-1], node, "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout
    assert re.fullmatch(r"1 passed in [\d.]+s", proc.stdout.strip().splitlines()[-1]), proc.stdout


def test_a_typo_of_a_synonym_leads_to_the_real_key(capsys, monkeypatch):
    """megacann-train's entry point in-process (tests/test_dry_run.py runs the installed command)."""
    monkeypatch.chdir(ROOT)
    for override in ("optim.learnig_rate=1e-3", "optim.learning_rate=1e-3"):
        code = train_main(["--config", "examples/configs/llama/tiny.yaml", override])
        err = capsys.readouterr().err
        assert code == 2
        assert err.strip().endswith("did you mean 'optim.lr'?"), err


def test_readme_preprocessing_example_runs_as_written(tmp_path):
    (line,) = [c for c in _readme_block("More ways in:") if c.startswith("megacann-preprocess")]
    args = shlex.split(line)
    args[args.index("--output_prefix") + 1] = str(tmp_path / "megacann_src")  # the README writes into data/
    proc = subprocess.run(
        [console_script(args[0]), *args[1:]], cwd=ROOT, capture_output=True, text=True, env=user_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {tmp_path / 'megacann_src'}.bin/.idx: ")
    assert (tmp_path / "megacann_src.bin").stat().st_size > 0 and (tmp_path / "megacann_src.idx").exists()


def test_missing_tokenizer_names_the_ways_out(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello world"}\n')
    proc = subprocess.run(
        [console_script("megacann-preprocess"), "--input", str(corpus), "--output_prefix", str(tmp_path / "c")]
        + ["--tokenizer", "tok/"],
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=120,
    )
    assert proc.returncode == 1
    message = proc.stderr.strip()
    assert message.startswith("megacann-preprocess: error: tokenizer 'tok/' not found")
    assert "--tokenizer default" in message and "--train_tokenizer N --tokenizer DIR" in message
    assert len(message.splitlines()) == 1


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_and_in_a_log():
    bar = ProgressBar("tokenizing", total=200, unit="files", stream=_Terminal())
    bar.start -= 10.0  # ten seconds in
    bar.last = 0.0
    bar.advance(50, "1,000 docs")
    line = bar.stream.getvalue()
    assert line.startswith("\rtokenizing | [######..................]  25% | 50/200 files | 30s left | 1,000 docs")
    bar.advance(150)
    bar.close()
    assert bar.stream.getvalue().endswith(" 100% | 200/200 files | 1,000 docs | 10s\n")

    log = io.StringIO()  # not a terminal: nothing until LOG_EVERY_S passed, then whole lines
    quiet = ProgressBar("tokenizing", total=None, unit="MiB", stream=log)
    quiet.advance(3)
    quiet.close()
    assert log.getvalue() == ""
    quiet.last = -100.0
    quiet.advance(2)
    assert re.fullmatch(r"tokenizing \| 5 MiB \| \d+s\n", log.getvalue())
