"""What a process of a run asks about itself, and how it writes a file another process may read.

- Ranks: torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``;
  https://pytorch.org/docs/stable/elastic/run.html), readable before any process group exists; one process
  without torchrun is rank 0 of 1. Read here only (tests/test_layering.py).
- Atomic writes: the content goes to a temporary file beside the target, which is then renamed over it
  (``os.replace``: atomic within one filesystem on POSIX), so a reader, or a rerun after a kill, sees the old
  file or the whole new one, never a part; work built beside its place (a staged directory, a dataset's files,
  a checkpoint's trackers) goes there the same way (:func:`publish`, :func:`rename_into_place`). The one home of
  both (tests/test_layering.py).
- YAML reads: :func:`read_yaml`, ``yaml.safe_load``'s result through libyaml where PyYAML has it (a run's
  ``run_config.yaml`` parses in ~10 ms instead of ~100 ms).
- Mapped reads: a byte range of a file as a tensor, without a copy (:func:`map_range`: safetensors shards and
  torch_dist chunks).

Imports nothing of ours and nothing heavy (torch only inside :func:`world_size` and :func:`map_range`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from typing import Any

__all__ = ["is_last_rank", "is_rank_zero", "launcher_local_rank", "launcher_rank", "launcher_set_ranks",
           "launcher_world_size", "map_range", "publish", "read_yaml", "rename_into_place", "world_size",
           "write_atomic"]


# ---------------------------------------------------------------------------------------------- ranks
def is_rank_zero() -> bool:
    """Whether torchrun's ``RANK`` is 0 (unset: one process, rank 0): the process that prints and writes."""
    return os.environ.get("RANK", "0") == "0"


def is_last_rank() -> bool:
    """Whether torchrun's ``RANK`` is ``WORLD_SIZE - 1`` (unset: one process, which is also the last)."""
    return int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1


def launcher_rank() -> int:
    """This process's rank as the launcher (torchrun, or Slurm through ``bridge_ext.slurm``) set it; 0 without one."""
    return int(os.environ.get("RANK", "0"))


def launcher_local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``: its GPU); 0 without a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launcher_set_ranks() -> bool:
    """Whether a launcher already set this process's rank (torchrun's ``RANK``)."""
    return "RANK" in os.environ


def launcher_world_size() -> int | None:
    """The number of ranks a launcher (torchrun, or another that sets ``WORLD_SIZE``) started; None without one."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def world_size() -> int:
    """Processes in this run: the process group's size once it exists, else torchrun's ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


# -------------------------------------------------------------------------------------------- reading
def read_yaml(source: str | Path | Any) -> Any:
    """``yaml.safe_load(source)``: the same tags and types, parsed by libyaml (``CSafeLoader``) where PyYAML was
    built with it. ``source``: YAML text, a text stream, or a file's :class:`~pathlib.Path`."""
    import yaml

    if isinstance(source, Path):
        source = source.read_text()
    return yaml.load(source, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


# -------------------------------------------------------------------------------------------- writing
def write_atomic(path: str | Path, data: str | bytes, *, fsync: bool = False) -> None:
    """Replace ``path``'s content by ``data`` (text is written as UTF-8) in one rename.

    The temporary file is ``.<name>.tmp<pid>`` in the same directory (same filesystem; one per process, so two
    ranks writing the same file do not share it). ``fsync``: the bytes reach the disk before the rename (a
    checkpoint tracker that must survive a crash of the machine, not only of the process). On any failure the
    temporary file is removed and ``path`` keeps its old content (or stays absent)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def publish(staged: str | Path, final: str | Path) -> None:
    """Move a file or directory built beside ``final`` (same filesystem) into its place in one rename
    (``os.replace``: atomic on POSIX; a file replaces ``final``, a directory needs ``final`` absent or empty). The
    one way our code makes finished work visible: a reader sees the old or the whole new, never a part."""
    os.replace(staged, final)


def rename_into_place(staged: Path, final: Path, *, marker: str) -> None:
    """Rename the directory ``staged`` (built beside ``final``) to ``final``. Another process that built the same
    content and renamed it into place first (``final/marker`` exists) is not an error: ``staged`` stays for the
    caller to remove."""
    try:
        publish(staged, final)
    except OSError:
        if not (final / marker).is_file():
            raise


# ---------------------------------------------------------------------------------------------- mapped reads
def map_range(fd: int, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """The ``nbytes`` of ``fd`` at ``offset`` as a tensor backed by a private (copy-on-write) memory map of just that
    range: no copy is made to read it (the page cache is mapped; measured ~3x less CPU than ``preadv`` into a new
    tensor then written out), writes to it stay private, and the map goes with the tensor."""
    import torch

    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, nbytes + offset - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=start)  # fmt: skip
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset - start)
    return flat.view(dtype).view(shape)
