"""A checkpoint from someone else runs no code (issue 37, part 1): a pickle planted in any file a load reads
(DCP's ``.metadata``, ``common.pt``, ``train_state.pt``, the root's tracker ``latest_train_state.pt``) is
refused in one line, exit 2, by every command that reads a checkpoint; nothing it would do happens (its marker
file stays absent) and nothing is written. A legitimate checkpoint still exports and resumes."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from bridge_ext.checkpoints.pickles import vet_checkpoint
from bridge_ext.errors import UserError

RECIPE = "qwen3_proxy_muon"
ITERS = 2
pytestmark = [pytest.mark.stack, pytest.mark.slow]


class Planted:
    """Unpickled, it creates its marker file (what a real attack would do with os.system)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cpu_mode):
    """A legitimate checkpoint: the Qwen3 proxy, 2 iterations, saved."""
    from bridge_ext.commands import main

    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["llm", "pretrain", "--recipe", RECIPE, f"train.train_iters={ITERS}", f"checkpoint.save={run}",
                 f"checkpoint.load={run}", "checkpoint.save_interval=2"]) == 0
    return run


# file -> how the planted pickle is written: a raw pickle (as .metadata is), or a torch.save zip whose data.pkl
# holds it (as the .pt files are)
PLANTS = {
    f"iter_{ITERS:07d}/.metadata": "raw",
    f"iter_{ITERS:07d}/common.pt": "torch.save",
    f"iter_{ITERS:07d}/train_state.pt": "torch.save",
    "latest_train_state.pt": "raw",
}


def plant(trained: Path, tmp_path: Path, where: str, how: str) -> tuple[Path, Path]:
    """A copy of the checkpoint with ``where`` replaced; (its root, the marker the pickle would create)."""
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    marker = tmp_path / "PLANTED_CODE_RAN"
    target = root / where
    if how == "raw":
        target.write_bytes(pickle.dumps(Planted(marker)))
    else:
        torch.save(Planted(marker), target)
    return root, marker


def one_line(result, root: Path, where: str) -> None:
    err = result.stderr
    assert result.code == 2, (result.code, err[-3000:])
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "posix.system" in line and "refused, nothing of it was run" in line, err
    assert str(root / where.split("/")[-1]) in line or where.split("/")[-1] in line, line


COMMANDS = ["export", "export --no-stream", "resume", "pretrained_checkpoint"]
# Every stack: DCP's .metadata (read with a plain pickle.load) through export and resume; the whole grid on the
# first stack (the vetting is our code, before any upstream read, on every stack alike)
CASES = [pytest.param(where, command, marks=() if where.endswith(".metadata") and command in ("export", "resume")
                      else pytest.mark.once) for where in PLANTS for command in COMMANDS]


@pytest.mark.parametrize("where, command", CASES)
def test_a_planted_pickle_runs_nothing_and_is_one_line(trained, tmp_path, nemo, where, command):
    root, marker = plant(trained, tmp_path, where, PLANTS[where])
    out = tmp_path / "out"
    if command.startswith("export"):
        argv = ["llm", "export", "--ckpt", root, "--out", out, *command.split()[1:]]
    elif command == "resume":
        argv = ["llm", "pretrain", "--recipe", RECIPE, f"checkpoint.load={root}", f"checkpoint.save={out}",
                f"train.train_iters={ITERS + 1}"]
    else:
        argv = ["llm", "pretrain", "--recipe", RECIPE, f"checkpoint.pretrained_checkpoint={root}",
                f"checkpoint.save={out}", f"train.train_iters={ITERS + 1}"]
    result = nemo(argv, cwd=tmp_path)
    assert not marker.exists(), "the planted code ran"
    one_line(result, root, where)
    assert not out.exists()  # nothing written


def test_a_planted_global_behind_memo_and_stack_global_is_found(tmp_path):
    """Protocol 4's STACK_GLOBAL with the names fetched from the memo: the C unpickler resolves them, so does
    the vetting (it sees what a load would import, not what a scan of opcodes guesses)."""
    import pickletools

    marker = tmp_path / "PLANTED_CODE_RAN"
    data = pickletools.optimize(pickle.dumps(Planted(marker), protocol=4))
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / ".metadata").write_bytes(data)
    with pytest.raises(UserError, match="names posix.system"):
        vet_checkpoint(tmp_path / "iter_0000001")
    assert not marker.exists()


def test_a_legitimate_checkpoint_is_vetted_in_milliseconds(trained):
    import time

    start = time.perf_counter()
    vet_checkpoint(trained / f"iter_{ITERS:07d}", trained)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_a_damaged_pickle_is_one_line_naming_the_file(trained, tmp_path, damage):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    metadata = root / f"iter_{ITERS:07d}" / ".metadata"
    data = metadata.read_bytes()
    metadata.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    with pytest.raises(UserError, match=rf"{metadata} is not a readable pickle .*the checkpoint is damaged"):
        vet_checkpoint(metadata.parent, root)
