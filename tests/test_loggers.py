"""Loggers as a user meets them through megacann-train: wandb (offline, no network) and TensorBoard receive
the metrics of metrics.jsonl; the ETA ignores the warm-up step; a fresh start moves an earlier
metrics.jsonl aside and a resume drops the records logged past the step it resumes from."""

import glob
import json
import shutil
import subprocess

import pytest
from cli_helpers import ROOT, console_script, user_env

from megacann.training.metrics import EtaEstimate, flatten_scalars

MEGACANN_TRAIN = console_script("megacann-train")
SMALL = [
    "examples/configs/llama/tiny.yaml",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.num_layers=2",
    "data.seq_length=32",
    "data.batch_size=2",
    "data.num_workers=0",
    "logging.log_interval=1",
    "logging.ckpt_interval=2",
    "logging.eval_interval=2",
    "logging.eval_iters=1",
]


def test_eta_leaves_out_the_warm_up_and_follows_the_recent_pace():
    eta = EtaEstimate(max_steps=100)
    assert eta.update(1, now=50.0) is None  # warm-up step: a slow one, no basis for a forecast
    assert eta.update(10, now=62.0) is None  # steps 2-10 still warm up (data workers, allocator)
    assert eta.update(20, now=67.0) == pytest.approx(0.5 * 80)  # 10 steps in 5 s after step 10
    assert eta.update(30, now=69.0) == pytest.approx(7.0 / 20 * 70)
    for step in range(40, 100, 10):  # a slower stretch: the window forgets the old pace
        eta.update(step, now=69.0 + (step - 30) * 0.2)
    assert eta.update(100, now=69.0 + 70 * 0.2) == 0.0
    assert eta.marks[-1] == (100, pytest.approx(83.0))
    late = EtaEstimate(max_steps=1000)
    for i, step in enumerate(range(10, 400, 10)):
        remaining = late.update(step, now=float(i if step <= 200 else 19 + 3 * (i - 19)))
    assert remaining == pytest.approx(0.3 * 610)  # 3 s per 10 steps lately, whatever came before


def test_flatten_scalars_names_nested_values():
    record = {"step": 3, "loss": 2.5, "updated": True, "stage_timers": {"forward_s": [0.1, 0.2]}, "note": "x"}
    assert flatten_scalars(record) == {
        "loss": 2.5,
        "updated": 1.0,
        "stage_timers/forward_s/0": 0.1,
        "stage_timers/forward_s/1": 0.2,
    }


def _train(out, *overrides, ranks: int = 2):
    env = user_env({"WANDB_SILENT": "true"})
    env.pop("WANDB_API_KEY", None)
    # by default two ranks (data parallel) through the launcher: the loggers live on rank 0 only
    launch = ["--nproc_per_node", str(ranks)] if ranks > 1 else []
    args = [MEGACANN_TRAIN, *launch, "--config", *SMALL, f"experiment.output_dir={out}", *overrides]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _wandb_history(run_file: str) -> tuple[dict, list[dict]]:
    """The run record (name, project) and the history rows of an offline wandb run file: a LevelDB-style log
    (32 KiB blocks of chunks with a 7-byte header: crc, length, type) of protobuf Records after a 7-byte
    file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, chunks, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    run, rows = {}, []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"name": record.run.display_name, "project": record.run.project}
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return run, rows


@pytest.mark.extended
def test_wandb_offline_tensorboard_and_metrics_file_across_restarts(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    first = _train(
        out,
        "optim.max_steps=4",
        "logging.wandb=true",
        "logging.wandb_mode=offline",
        "logging.wandb_project=megacann-tests",
        "logging.wandb_run_name=first-try",
        "logging.tensorboard=true",
    )
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    expected = {}  # (step, metric) -> value, as metrics.jsonl has it
    for record in records:
        expected.update({(record["step"], k): v for k, v in flatten_scalars(record).items()})
    assert ("eval_loss" in {k for _, k in expected}) and (2, "tokens_per_second") in expected

    # TensorBoard: one writer, every metric of every record at its step
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    seen = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert set(seen) == set(expected)
    for key, value in expected.items():
        assert seen[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key

    # wandb, offline: the run's name and project, and the same metrics at the same steps
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))
    run, rows = _wandb_history(run_file)
    assert run == {"name": "first-try", "project": "megacann-tests"}
    logged = {(row["_step"], k): v for row in rows for k, v in row.items() if not k.startswith("_")}
    assert logged == pytest.approx(expected)

    # the console: no ETA on the first two lines (warm-up), one on the next lines
    lines = [line for line in first.stdout.splitlines() if line.startswith("step ") and " | loss " in line]
    assert not any("eta" in line for line in lines[:2]) and all(" | eta " in line for line in lines[2:]), lines

    # a run that died after logging step 4 but before its checkpoint: resuming from step 2 redoes 3 and 4
    shutil.rmtree(out / "checkpoint_4")
    (out / "latest").write_text("checkpoint_2\n")
    second = _train(out, "optim.max_steps=4")
    assert "metrics.jsonl: dropped 3 records logged after step 2, the step resumed from" in second.stdout
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]

    # a fresh start in the same folder (no checkpoint left): the earlier file moves aside, whole
    for path in out.glob("checkpoint_*"):
        shutil.rmtree(path)
    (out / "latest").unlink()
    third = _train(out, "optim.max_steps=2", ranks=1)
    (aside,) = glob.glob(str(out / "metrics.*.jsonl"))
    assert f"metrics.jsonl of an earlier run in this output_dir moved aside to {aside}" in third.stdout
    assert _records(aside) == records
    assert [r["step"] for r in _records(out / "metrics.jsonl") if "loss" in r] == [1, 2]
