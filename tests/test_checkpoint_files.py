"""Checkpoint directories: completion, ``latest``, keep_last rotation, resume lookup, stale temporaries."""

import os

import pytest

from megacann.checkpoint.files import (
    COMPLETE_MARKER,
    find_resume_checkpoint,
    latest_checkpoint,
    list_complete_checkpoints,
    publish,
    remove_stale_temporaries,
    rotate,
    write_latest,
)


def _make(out, step, complete=True, suffix=""):
    path = os.path.join(out, f"checkpoint_{step}{suffix}")
    os.makedirs(path)
    with open(os.path.join(path, "data"), "w") as f:
        f.write("x")
    if complete:
        with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
            f.write(f"{step}\n")
    return path


def test_only_complete_checkpoints_count(tmp_path):
    out = str(tmp_path)
    _make(out, 10)
    _make(out, 30, complete=False)  # half-written (old format or copied by hand)
    _make(out, 40, suffix=".tmp")  # a save that was killed
    assert [s for s, _ in list_complete_checkpoints(out)] == [10]
    assert latest_checkpoint(out).endswith("checkpoint_10")
    write_latest(out, os.path.join(out, "checkpoint_30"))  # a pointer to an incomplete one is not trusted
    assert latest_checkpoint(out).endswith("checkpoint_10")


def test_publish_then_latest(tmp_path):
    out = str(tmp_path)
    tmp = _make(out, 5, complete=False, suffix=".tmp")
    publish(tmp, os.path.join(out, "checkpoint_5"), 5)
    assert not os.path.exists(tmp)
    assert os.path.isfile(os.path.join(out, "checkpoint_5", COMPLETE_MARKER))
    write_latest(out, os.path.join(out, "checkpoint_5"))
    with open(os.path.join(out, "latest")) as f:
        assert f.read().strip() == "checkpoint_5"
    assert latest_checkpoint(out).endswith("checkpoint_5")


def test_keep_last_rotation(tmp_path):
    out = str(tmp_path)
    for step in (2, 4, 6, 8):
        _make(out, step)
    _make(out, 9, complete=False)
    write_latest(out, os.path.join(out, "checkpoint_8"))
    removed = rotate(out, 2)
    assert sorted(os.path.basename(p) for p in removed) == ["checkpoint_2", "checkpoint_4"]
    assert [s for s, _ in list_complete_checkpoints(out)] == [6, 8]
    assert os.path.isdir(os.path.join(out, "checkpoint_9"))  # incomplete ones are not its business
    assert rotate(out, None) == [] and rotate(out, 0) == []


def test_keep_last_never_deletes_the_only_or_latest(tmp_path):
    out = str(tmp_path)
    _make(out, 3)
    assert rotate(out, 1) == []
    _make(out, 7)
    write_latest(out, os.path.join(out, "checkpoint_3"))  # e.g. resumed from an older one by hand
    rotate(out, 1)
    assert os.path.isdir(os.path.join(out, "checkpoint_3")) and os.path.isdir(os.path.join(out, "checkpoint_7"))


def test_find_resume_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    assert find_resume_checkpoint(out, None) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        find_resume_checkpoint(out, "latest")
    _make(out, 4)
    _make(out, 8)
    half = _make(out, 12, complete=False)
    assert find_resume_checkpoint(out, None).endswith("checkpoint_8")
    assert find_resume_checkpoint(out, "latest").endswith("checkpoint_8")
    assert find_resume_checkpoint(os.path.join(out, "checkpoint_4"), None) is None  # another output_dir
    assert find_resume_checkpoint(out, os.path.join(out, "checkpoint_4")).endswith("checkpoint_4")
    assert find_resume_checkpoint(str(tmp_path), out).endswith("checkpoint_8")  # an output dir given
    with pytest.raises(ValueError, match="incomplete"):
        find_resume_checkpoint(out, half)
    with pytest.raises(FileNotFoundError, match="no such"):
        find_resume_checkpoint(out, os.path.join(out, "nope"))


def test_stale_temporaries_are_removed(tmp_path):
    out = str(tmp_path)
    _make(out, 1)
    _make(out, 2, complete=False, suffix=".tmp")
    _make(out, 3, suffix=".old")
    assert sorted(remove_stale_temporaries(out)) == ["checkpoint_2.tmp", "checkpoint_3.old"]
    assert os.listdir(out) == ["checkpoint_1"]
