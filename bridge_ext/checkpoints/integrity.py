"""A saved iteration is what was saved: sizes and CRC-32s recorded at save time, checked before export and resume.

**The record.** After a save, every rank writes ``iter_N/.integrity/rank_<rank>.json`` (:func:`record_save`,
called by ``bridge_ext.kill_safe`` before the trackers move, so a committed iteration has every rank's record, and
by ``nemo llm import``):
for each file the rank wrote -- its ``__<rank>_<n>.distcp`` data files; rank 0 also ``.metadata``,
``common.pt``, ``metadata.json``, ``train_state.pt``, ``run_config.yaml`` and the tokenizer -- the size, and the
CRC-32 of each stored item (a tensor chunk or an object, as ``.metadata`` places it in the file; whole files
for the others). Per item, so that a mismatch names the tensor, and so that export checks only the model's items
(it reads no optimizer state). CRC-32 (``zlib.crc32``: the standard library, 4.2 GB/s on one core here, and it
releases the GIL, so threads add up) catches every burst error up to 32 bits and random damage with
probability 1 - 2^-32; it is no defence against someone who edits a file on purpose (that is what
:mod:`~bridge_ext.checkpoints.pickles` is for).

**The checks** (:func:`verify`), in one line naming the file and the tensor where known, exit 2, before anything
loads: every file ``.metadata`` places an item in exists and is long enough (a missing, zero-length or
truncated ``.distcp``; a ``.metadata`` from another save) -- a ``stat`` per file, no record needed; then, where
the iteration has a record: every rank's record is there, every file has its recorded size, and every item's
CRC-32 matches (a bit flip in a weight or an optimizer shard, a file replaced by another). A resume splits the
items between its ranks (each reads about what one rank wrote); export checks the model's items.

Imports nothing heavy at module level.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bridge_ext.checkpoints.pickles import load_metadata
from bridge_ext.checkpoints.torch_dist import TorchDistChunks
from bridge_ext.errors import UserError
from bridge_ext.runtime import write_atomic

__all__ = ["FLAG", "RECORD_DIR", "Scope", "Verified", "record_save", "verify", "write_record"]

RECORD_DIR = ".integrity"
_FORMAT = 1
_READ = 8 << 20  # bytes per read while checksumming: bounded memory whatever an item's size
_RECORD_MAX = 256 << 20  # a record larger than this is not one of ours (Kimi K2's rank records are ~100 KB)
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
Scope = Literal["all", "model"]
FLAG = "--no-checksums"  # how a user skips the checksums (the commands define it)


def _record_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _crc(path: Path, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of ``path`` from ``offset``, read into one reused buffer."""
    crc, end = 0, offset + length
    view = memoryview(bytearray(min(_READ, length) or 1))
    fd = os.open(path, os.O_RDONLY)
    try:
        while offset < end:
            got = os.preadv(fd, [view[: min(_READ, end - offset)]], offset)
            if not got:
                raise EOFError(f"ends at byte {offset}")
            crc = zlib.crc32(view[:got], crc)
            offset += got
    finally:
        os.close(fd)
    return crc


def _owned_files(iter_dir: Path, rank: int) -> list[str]:
    """The files of ``iter_dir`` that ``rank`` wrote: its data files; rank 0 also every other file (the staged
    trackers and the records aside)."""
    owned = []
    for directory, subdirs, files in os.walk(iter_dir):
        subdirs[:] = [d for d in subdirs if d != RECORD_DIR]
        for name in files:
            relative = os.path.relpath(os.path.join(directory, name), iter_dir)
            match = _DATA_FILE.match(relative)
            if match is not None:
                if int(match.group(1)) == rank:
                    owned.append(relative)
            elif rank == 0 and not name.startswith(".commit.") and ".tmp" not in name:
                owned.append(relative)
    return sorted(owned)


def _segments(size: int, items: list[tuple[int, int, str | None, list[int] | None]]) -> list[list[Any]]:
    """``[offset, length, key, offsets]`` covering ``[0, size)``: the items in file order, and the gaps between."""
    segments, position = [], 0
    for offset, length, key, offsets in sorted(items, key=lambda item: item[0]):
        if offset > position:
            segments.append([position, offset - position, None, None])
        segments.append([offset, length, key, offsets])
        position = max(position, offset + length)
    if position < size:
        segments.append([position, size - position, None, None])
    return segments


def write_record(iter_dir: str | Path, *, rank: int, world_size: int) -> int:
    """Write ``rank``'s record of the files it wrote in ``iter_dir`` (after the save, once ``.metadata`` is there);
    returns the bytes checksummed. The files were just written: they are read back from the page cache."""
    iter_dir = Path(iter_dir)
    files = _owned_files(iter_dir, rank)
    items: dict[str, list[tuple[int, int, str | None, list[int] | None]]] = {f: [] for f in files}
    if any(_DATA_FILE.match(f) for f in files):
        metadata = load_metadata(iter_dir)
        for index, info in (metadata.storage_data or {}).items():
            if info.relative_path in items:
                offsets = None if index.offset is None else [int(o) for o in index.offset]
                items[info.relative_path].append((int(info.offset), int(info.length), index.fqn, offsets))
    plan = {name: _segments(os.path.getsize(iter_dir / name), items[name]) for name in files}
    jobs = [(name, segment) for name in files for segment in plan[name]]
    with concurrent.futures.ThreadPoolExecutor(_threads()) as pool:  # zlib.crc32 releases the GIL
        crcs = list(pool.map(lambda job: _crc(iter_dir / job[0], job[1][0], job[1][1]), jobs))
    done: dict[str, list[list[Any]]] = {name: [] for name in files}
    for (name, (offset, length, key, offsets)), crc in zip(jobs, crcs):
        done[name].append([offset, length, crc, key, offsets])
    record = {"format": _FORMAT, "algorithm": "crc32", "rank": rank, "world_size": world_size,
              "files": {name: {"size": os.path.getsize(iter_dir / name), "items": done[name]} for name in files}}
    (iter_dir / RECORD_DIR).mkdir(exist_ok=True)
    write_atomic(iter_dir / RECORD_DIR / _record_name(rank), json.dumps(record, separators=(",", ":")), fsync=True)
    return sum(os.path.getsize(iter_dir / name) for name in files)


def record_save(iter_dir: str | Path) -> None:
    """Every rank of a save, once it returned: this rank's record, between two barriers (``.metadata``, which
    places the items, is complete before; every rank's record is there after). Training's saves
    (``bridge_ext.kill_safe``) and ``nemo llm import``'s (after it completed the directory) call it."""
    import torch

    dist = torch.distributed
    group = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if group else (1, 0)
    if world > 1:
        dist.barrier()
    write_record(iter_dir, rank=rank, world_size=world)
    if world > 1:
        dist.barrier()


@dataclass(frozen=True)
class Verified:
    """What :func:`verify` checked: files and bytes read for checksums (0 without a record), seconds."""

    files: int
    bytes: int
    seconds: float
    recorded: bool  # whether the iteration has an integrity record (saves without this package have none)

    def line(self, iter_dir: str | Path) -> str:
        if not self.recorded:
            return (f"integrity: {iter_dir} has no integrity record (saved without bridge_ext or with "
                    f"{FLAG}); its files' sizes were checked against .metadata, their contents were not")
        return (f"integrity: {self.bytes / 1e9:.2f} GB in {self.files} files of {iter_dir} match their checksums "
                f"({self.seconds:.1f} s)")


def _in_scope(key: str | None, scope: Scope) -> bool:
    return scope == "all" or key is None or not key.startswith("optimizer.")


def _damaged(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}; the checkpoint is damaged (use another iteration or a good copy)")


def _check_layout(iter_dir: Path, scope: Scope) -> None:
    """Every item ``.metadata`` places is in an existing file, within its size (a stat per file)."""
    if not (iter_dir / ".metadata").is_file():
        return
    problem = TorchDistChunks(iter_dir).missing_file(optimizer=scope == "all", objects=True)
    if problem is not None:  # a truncated file, or a .metadata of another save
        raise UserError(f"{problem}; the checkpoint is damaged (use another iteration or a good copy)")


def _read_records(iter_dir: Path) -> list[dict[str, Any]]:
    directory = iter_dir / RECORD_DIR
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("rank_*.json")):
        try:
            if path.stat().st_size > _RECORD_MAX:
                raise ValueError(f"{path.stat().st_size} bytes")
            record = json.loads(path.read_text())
            if record.get("format") != _FORMAT or record.get("algorithm") != "crc32":
                raise ValueError(f"format {record.get('format')!r}, algorithm {record.get('algorithm')!r}")
            int(record["world_size"]), int(record["rank"]), dict(record["files"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _damaged(path, f"not a readable integrity record ({exc})") from None
        records.append(record)
    world = records[0]["world_size"] if records else 0
    missing = sorted(set(range(world)) - {int(r["rank"]) for r in records})
    if missing:
        raise _damaged(directory / _record_name(missing[0]),
                       f"missing ({len(missing)} of the {world} ranks' records are; the copy is incomplete)")
    return records


def verify(iter_dir: str | Path, *, scope: Scope = "all", rank: int = 0, world_size: int = 1,
           checksums: bool = True) -> Verified:
    """Check ``iter_dir`` before it is loaded; ``UserError`` naming the file (and the tensor) on damage.

    ``scope``: ``"all"`` (a resume reads everything) or ``"model"`` (export, ``pretrained_checkpoint``: no optimizer
    state). ``rank``/``world_size``: this process checks every ``world_size``-th item from ``rank`` (the ranks of a
    resume share the work). ``checksums=False``: sizes only (what the ``--no-checksums`` flag asks for).
    """
    iter_dir = Path(iter_dir)
    start = time.perf_counter()
    _check_layout(iter_dir, scope)
    records = _read_records(iter_dir)
    for record in records:
        for name, entry in record["files"].items():
            path = iter_dir / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise _damaged(path, f"missing (rank {record['rank']} wrote it)") from None
            if size != entry["size"]:
                raise _damaged(path, f"{size} bytes, {entry['size']} when it was saved "
                                     f"({'truncated' if size < entry['size'] else 'grown'})")
    if not checksums or not records:
        return Verified(0, 0, time.perf_counter() - start, bool(records))
    work = [(name, item) for record in records for name, entry in sorted(record["files"].items())
            for item in entry["items"] if _in_scope(item[3], scope)][rank::world_size]

    def check(job: tuple[str, list[Any]]) -> tuple[str, list[Any]] | None:
        name, (offset, length, crc, _, _) = job
        try:
            return None if _crc(iter_dir / name, offset, length) == crc else job
        except (OSError, EOFError):
            return job

    with concurrent.futures.ThreadPoolExecutor(_threads()) as pool:
        bad = next((job for job in pool.map(check, work) if job is not None), None)
    if bad is not None:
        name, (offset, length, _, key, offsets) = bad
        what = "" if key is None else f"{key}: " if offsets is None else f"{key} at {offsets}: "
        raise _damaged(iter_dir / name, f"{what}bytes {offset}-{offset + length} do not match the checksum "
                                        f"recorded at save time (a bit flip, or the file was changed; {FLAG} "
                                        "skips this check)")
    return Verified(len({name for name, _ in work}), sum(item[1] for _, item in work), time.perf_counter() - start,
                    True)
