"""``bridge_ext.runtime``: torchrun's rank variables and atomic writes (the old file survives a failed write)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bridge_ext import runtime

pytestmark = pytest.mark.once


@pytest.mark.parametrize(("env", "zero", "last", "launched"), [
    ({}, True, True, None),  # one process without torchrun: rank 0 of 1
    ({"RANK": "0", "WORLD_SIZE": "4"}, True, False, 4),
    ({"RANK": "3", "WORLD_SIZE": "4"}, False, True, 4),
    ({"RANK": "2", "WORLD_SIZE": "4"}, False, False, 4),
])
def test_rank_checks_read_torchruns_variables(monkeypatch, env, zero, last, launched):
    import torch.distributed as dist

    # before any process group: a group another test of this xdist worker left would answer for the variables
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert runtime.is_rank_zero() is zero
    assert runtime.is_last_rank() is last
    assert runtime.launcher_world_size() == launched
    assert runtime.world_size() == (launched or 1)  # no process group in this process


def test_launcher_world_size_ignores_what_is_not_a_count(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "")
    assert runtime.launcher_world_size() is None
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert runtime.launcher_world_size() is None


@pytest.mark.parametrize("fsync", [False, True])
def test_write_atomic_writes_text_and_bytes(tmp_path, fsync):
    path = tmp_path / "a.yaml"
    runtime.write_atomic(path, "é: 1\n", fsync=fsync)
    assert path.read_bytes() == "é: 1\n".encode()
    runtime.write_atomic(path, b"\x00\x01", fsync=fsync)  # replaces the old content
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "tracker.txt"
    path.write_text("old")

    with pytest.raises(TypeError):  # neither str nor bytes: write() refuses it after the temporary exists
        runtime.write_atomic(path, 12345)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tracker.txt"]

    def failing_replace(src, dst):
        assert Path(src).read_text() == "new"  # the whole new content was written beside the target
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        runtime.write_atomic(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tracker.txt"]


def test_a_failed_first_write_leaves_no_file(tmp_path):
    path = tmp_path / "missing-dir" / "x.txt"
    with pytest.raises(FileNotFoundError):
        runtime.write_atomic(path, "x")
    assert not path.parent.exists()


def test_rename_into_place_accepts_another_process_build(tmp_path):
    final = tmp_path / "final"
    mine = tmp_path / ".tmp-mine"
    mine.mkdir()
    (mine / "done.json").write_text("mine")
    runtime.rename_into_place(mine, final, marker="done.json")
    assert (final / "done.json").read_text() == "mine" and not mine.exists()

    theirs = tmp_path / ".tmp-theirs"  # a second process built the same content and comes second
    theirs.mkdir()
    (theirs / "other.json").write_text("theirs")
    runtime.rename_into_place(theirs, final, marker="done.json")  # rename onto a non-empty directory fails
    assert (final / "done.json").read_text() == "mine" and theirs.exists()

    incomplete = tmp_path / "incomplete"  # what is there is not a finished build: the error is the caller's
    incomplete.mkdir()
    (incomplete / "part").write_text("x")
    again = tmp_path / ".tmp-again"
    again.mkdir()
    (again / "done.json").write_text("x")
    with pytest.raises(OSError):
        runtime.rename_into_place(again, incomplete, marker="done.json")
