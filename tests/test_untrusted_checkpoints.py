"""A checkpoint from someone else runs no code, and damage is named (issue 37).

A pickle planted in any file a load reads (DCP's ``.metadata``, ``common.pt``, ``train_state.pt``, the root's
tracker ``latest_train_state.pt``, an object inside a ``.distcp`` data file) is refused in one line, exit 2, by
every command that reads a checkpoint; nothing it would do happens (its marker file stays absent) and nothing is
written. A missing, empty, truncated or bit-flipped file, and a ``.metadata`` that disagrees with the files, are
one line naming the file and the tensor. A legitimate checkpoint still exports and resumes."""

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
                 f"checkpoint.load={run}", "checkpoint.save_interval=1"]) == 0  # iterations 1 and 2
    return run


# file -> how the planted pickle is written: a raw pickle (as .metadata is), or a torch.save zip whose data.pkl
# holds it (as the .pt files are)
PLANTS = {
    f"iter_{ITERS:07d}/.metadata": "raw",
    f"iter_{ITERS:07d}/common.pt": "torch.save",
    f"iter_{ITERS:07d}/train_state.pt": "torch.save",
    "latest_train_state.pt": "raw",
    f"iter_{ITERS:07d}/rng_state": "object",  # a DCP bytes item in a .distcp file (see plant_object)
}


def plant(trained: Path, tmp_path: Path, where: str, how: str) -> tuple[Path, Path]:
    """A copy of the checkpoint with ``where`` replaced; (its root, the marker the pickle would create)."""
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    marker = tmp_path / "PLANTED_CODE_RAN"
    target = root / where
    if how == "raw":
        target.write_bytes(pickle.dumps(Planted(marker)))
    elif how == "object":
        plant_object(target.parent, "rng_state/shard_0.0_1.1", marker)
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
# The whole grid on every stack: each case stops before anything heavy runs (a fraction of a second in process)
CASES = [(where, command) for where in PLANTS for command in COMMANDS]


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


# ------------------------------------------------------------------------ objects inside the data files
def stored_objects(iter_dir: Path) -> dict[str, tuple[str, int, int]]:
    """DCP bytes items by key: (file, offset, length), as torch's own reader sees them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(str(iter_dir)).read_metadata()
    return {index.fqn: (info.relative_path, info.offset, info.length) for index, info in metadata.storage_data.items()
            if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)}


def plant_object(iter_dir: Path, key: str, marker: Path) -> bytes:
    """Append a planted ``torch.save`` record to the file holding ``key`` and point ``.metadata`` at it (what an
    attacker would do); returns the record."""
    import dataclasses
    import io

    from torch.distributed.checkpoint import FileSystemReader

    buffer = io.BytesIO()
    torch.save(Planted(marker), buffer)
    record = buffer.getvalue()
    metadata = FileSystemReader(str(iter_dir)).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    data_file = iter_dir / info.relative_path
    offset = data_file.stat().st_size
    with data_file.open("ab") as stream:
        stream.write(record)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(record))
    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return record


def object_groups(trained: Path) -> list[str]:
    """One key per kind of object the stack stores in the data files (rng_state everywhere, megatron-core 0.19's
    common_state, Transformer Engine-less _extra_state)."""
    keys = stored_objects(trained / f"iter_{ITERS:07d}")
    groups = {}
    for key in sorted(keys):
        groups.setdefault(key.split("/")[0].rsplit(".", 1)[-1], key)
    return sorted(groups.values())


def test_an_object_planted_in_a_data_file_runs_nothing(trained, tmp_path):
    """DCP reads every bytes item with torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes): the planted
    record runs there (checked first), and the vetting refuses it, for every kind of object the stack stores."""
    import io

    groups = object_groups(trained)
    assert any(key.startswith("rng_state") for key in groups), groups
    for key in groups:
        root = tmp_path / key.replace("/", "_")
        shutil.copytree(trained, root)
        marker = tmp_path / f"RAN_{len(key)}"
        record = plant_object(root / f"iter_{ITERS:07d}", key, marker)
        torch.load(io.BytesIO(record), weights_only=False)  # what a resume would do with it
        assert marker.exists(), "the planted record is not live"
        marker.unlink()
        with pytest.raises(UserError) as refused:
            vet_checkpoint(root / f"iter_{ITERS:07d}", root)
        message = str(refused.value)
        assert "posix.system" in message and f"the object {key} at byte" in message and ".distcp" in message, message
        assert not marker.exists()


# ------------------------------------------------------------------------------------------- damage
def items(iter_dir: Path) -> list[tuple[str, tuple[int, ...], str, int, int]]:
    """Every tensor chunk: (key, offsets, file, offset, length), from torch's own reader."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iter_dir)).read_metadata()
    return [(index.fqn, tuple(index.offset), info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items() if index.offset is not None]


def flip(path: Path, at: int) -> None:
    with path.open("r+b") as stream:
        stream.seek(at)
        byte = stream.read(1)
        stream.seek(at)
        stream.write(bytes([byte[0] ^ 0x10]))


def damaged_copy(trained: Path, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy with ``damage``; (its root, what the one line must name: the file and, where known, the tensor)."""
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    iter_dir = root / f"iter_{ITERS:07d}"
    chunks = items(iter_dir)
    weight = next(c for c in chunks if c[0].endswith("linear_fc1.weight"))
    if damage == "bit flip in a weight":
        flip(iter_dir / weight[2], weight[3] + weight[4] // 2)
        return root, f"{iter_dir / weight[2]}: {weight[0]} at {list(weight[1])}: bytes {weight[3]}-"
    if damage == "empty data file":
        (iter_dir / weight[2]).write_bytes(b"")
        return root, f"{iter_dir / weight[2]} is 0 bytes, shorter than .metadata says ("
    if damage == "truncated data file":
        os.truncate(iter_dir / weight[2], weight[3] + weight[4] // 2)
        return root, f"{iter_dir / weight[2]} is {weight[3] + weight[4] // 2} bytes, shorter than .metadata says ("
    if damage == "missing data file":
        (iter_dir / weight[2]).unlink()
        return root, f"{iter_dir / weight[2]} is missing (it holds "
    if damage == "another save's .metadata":
        shutil.copy(root / "iter_0000001" / ".metadata", iter_dir / ".metadata")
        return root, f"{iter_dir / '.metadata'}: bytes 0-"
    raise AssertionError(damage)


DAMAGE = ["bit flip in a weight", "empty data file", "truncated data file", "missing data file",
          "another save's .metadata"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_named_before_anything_loads(trained, tmp_path, damage):
    from bridge_ext.checkpoints import find_iteration
    from bridge_ext.checkpoints.integrity import verify

    root, named = damaged_copy(trained, tmp_path, damage)
    iter_dir, _ = find_iteration(root)
    for scope in ("model", "all"):
        with pytest.raises(UserError) as error:
            verify(iter_dir, scope=scope)
        assert str(error.value).startswith(named) and "the checkpoint is damaged" in str(error.value), str(error.value)
        assert "\n" not in str(error.value)


def test_a_bit_flip_in_the_optimizer_state_stops_a_resume_not_an_export(trained, tmp_path):
    from bridge_ext.checkpoints.integrity import verify

    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    iter_dir = root / f"iter_{ITERS:07d}"
    key, offsets, file, offset, length = next(c for c in items(iter_dir) if c[0].startswith("optimizer."))
    flip(iter_dir / file, offset + length - 1)
    assert verify(iter_dir, scope="model").recorded  # export reads no optimizer state
    with pytest.raises(UserError) as error:
        verify(iter_dir, scope="all")
    assert str(error.value).startswith(f"{iter_dir / file}: {key} at {list(offsets)}: bytes {offset}-"), error.value
    # the ranks of a resume share the work: exactly one of two finds it
    found = []
    for rank in (0, 1):
        try:
            verify(iter_dir, scope="all", rank=rank, world_size=2)
        except UserError:
            found.append(rank)
    assert len(found) == 1, found
    assert not verify(iter_dir, scope="all", checksums=False).bytes  # --no-checksums: sizes only


def test_a_missing_or_unreadable_record_is_named(trained, tmp_path):
    import json

    from bridge_ext.checkpoints.integrity import verify

    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    iter_dir = root / f"iter_{ITERS:07d}"
    record = iter_dir / ".integrity" / "rank_00000.json"
    saved = json.loads(record.read_text())
    # one process wrote every file of the iteration (common.pt or not: megatron-core 0.19 writes none)
    assert set(saved["files"]) == {str(f.relative_to(iter_dir)) for f in iter_dir.rglob("*")
                                   if f.is_file() and ".integrity" not in f.parts}
    assert {".metadata", "train_state.pt", "run_config.yaml"} <= set(saved["files"])
    record.write_text(json.dumps({**saved, "world_size": 2}))  # a copy that lost rank 1's record
    with pytest.raises(UserError, match=r"rank_00001.json: missing \(1 of the 2 ranks' records are"):
        verify(iter_dir)
    record.write_text("{")
    with pytest.raises(UserError, match=r"rank_00000.json: not a readable integrity record"):
        verify(iter_dir)
    shutil.rmtree(iter_dir / ".integrity")
    result = verify(iter_dir)  # a checkpoint saved without this package: sizes only, and said so
    assert not result.recorded and "has no integrity record" in result.line(iter_dir)


def damaged_command(command: str, root: Path, out: Path) -> list:
    if command.startswith("export"):
        return ["llm", "export", "--ckpt", root, "--out", out, *command.split()[1:]]
    key = "checkpoint.load" if command == "resume" else "checkpoint.pretrained_checkpoint"
    return ["llm", "pretrain", "--recipe", RECIPE, f"{key}={root}", f"checkpoint.save={out}",
            f"train.train_iters={ITERS + 1}"]


DAMAGE_CASES = [(damage, command) for damage in ("bit flip in a weight", "truncated data file", "missing data file")
                for command in COMMANDS]


@pytest.mark.parametrize("damage, command", DAMAGE_CASES)
def test_damage_is_one_line_in_every_command(trained, tmp_path, nemo, damage, command):
    root, named = damaged_copy(trained, tmp_path, damage)
    out = tmp_path / "out"
    result = nemo(damaged_command(command, root, out), cwd=tmp_path)
    assert result.code == 2, (result.code, result.stderr[-3000:])
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {named}") and "the checkpoint is damaged" in line, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_no_checksums_exports_what_the_record_would_refuse(trained, tmp_path, nemo):
    root, _ = damaged_copy(trained, tmp_path, "bit flip in a weight")
    result = nemo(["llm", "export", "--ckpt", root, "--out", tmp_path / "out", "--no-checksums"], cwd=tmp_path)
    assert result.code == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "config.json").is_file()
