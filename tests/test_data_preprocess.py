"""megacann-preprocess end to end (a subprocess with 2 workers) and the CSV/text -> SFT JSONL helper."""

import json
import os
import subprocess
from pathlib import Path

from cli_helpers import console_script, user_env

from megacann.data.convert import main as convert_main
from megacann.data.indexed_dataset import IndexedDataset
from megacann.data.preprocess import main as preprocess_main
from megacann.data.tokenizer import load_tokenizer

DOCS = [f"def f{i}(x):\n    return x ** {i}  # café {'☕' * (i % 3)}\n" * (1 + i % 4) for i in range(60)]


def run_cli(*args):
    cmd = [console_script("megacann-preprocess"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=user_env(), timeout=120)


def test_cli_with_two_workers_trains_tokenizer_and_writes_every_document(tmp_path):
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(DOCS[:20]):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(doc)
    (tmp_path / "more.jsonl").write_text(
        "\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS[20:])) + "\n"
    )
    tok_dir, prefix = str(tmp_path / "tok"), str(tmp_path / "out" / "corpus")
    args = ["--input", str(tmp_path / "txt"), "--input", str(tmp_path / "more.jsonl"), "--output_prefix", prefix]
    args += ["--tokenizer", tok_dir, "--train_tokenizer", "300", "--workers", "2", "--json_key", "body", "--append_eod"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "tokens/s with 2 worker(s)" in result.stdout
    tok = load_tokenizer(tok_dir)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(DOCS) and ds.dtype.name == "uint16"
    for i, doc in enumerate(DOCS):  # directory files sorted by name, then the JSONL lines in order
        assert ds[i].tolist() == tok.encode(doc) + [tok.eos_id]
    in_process = str(tmp_path / "one")
    assert (
        preprocess_main(
            [
                *args[:4],
                "--output_prefix",
                in_process,
                "--tokenizer",
                tok_dir,
                "--json_key",
                "body",
                "--append_eod",
                "--quiet",
            ]
        )
        == 0
    )
    for ext in (".bin", ".idx"):  # 1 worker and 2 workers write the same bytes
        assert Path(prefix + ext).read_bytes() == Path(in_process + ext).read_bytes()


def test_cli_bad_jsonl_line_names_file_and_line_and_leaves_no_output(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    args = ["--input", str(tmp_path / "bad.jsonl"), "--output_prefix", str(tmp_path / "o"), "--tokenizer", "byte"]
    assert preprocess_main(args) == 1
    assert "bad.jsonl:2: expected a JSON object with a string under key 'text'" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_convert_csv_and_text_to_sft_jsonl(tmp_path):
    (tmp_path / "qa.csv").write_text('question,context,answer\nWhat is 2+2?,,4\n"Say ""hi""",polite,"Hello,\nfriend"\n')
    (tmp_path / "pairs.txt").write_text("Translate: chat\tcat\nTwo lines?\tyes\\nno\n")
    out = tmp_path / "sft.jsonl"
    assert (
        convert_main(
            ["--input", str(tmp_path / "qa.csv"), "--input", str(tmp_path / "pairs.txt"), "--output", str(out)]
        )
        == 0
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0] == {"instruction": "What is 2+2?", "input": "", "output": "4"}
    assert records[1] == {"instruction": 'Say "hi"', "input": "polite", "output": "Hello,\nfriend"}
    assert records[3] == {"instruction": "Two lines?", "input": "", "output": "yes\nno"}
    (tmp_path / "bad.csv").write_text("prompt,response\nq,\n")
    assert convert_main(["--input", str(tmp_path / "bad.csv"), "--output", str(out)]) == 1
