"""A checkpoint from someone else runs no code: every pickle in it names only classes on an allow-list.

Megatron checkpoints hold pickles: torch DCP's ``.metadata`` (``FileSystemReader.read_metadata`` reads it with a
plain ``pickle.load``: a planted one runs its code in export and resume), ``torch.save`` files (``common.pt``,
``train_state.pt``, the tracker ``latest_train_state.pt``; their pickle is the zip's ``*/data.pkl``).
:func:`vet_checkpoint` reads each of them with Python's C unpickler before anything else does, with
``find_class`` answering only what the allow-list names and returning an inert stand-in even then (so not even
an allowed class runs), and ``persistent_load`` never touching tensor data: the cost is the pickles' size
(megabytes), not the weights'. A global outside the list is one ``UserError`` naming the file and the class; a
file that is not a readable pickle is named too.

The list is what legitimate checkpoints of the supported stacks hold (read from the proxies' checkpoints of
every layout): torch DCP's metadata dataclasses and enums, ``torch.Size``, dtypes, layouts, and what
``torch.load(weights_only=True)`` accepts for tensors (``torch._utils._rebuild_tensor_v2``, typed storages,
``collections.OrderedDict``, ``_codecs.encode`` for bytes), and numpy arrays (the RNG state).

Pickles also live *inside* the data files: every DCP bytes item (megatron-core's ``ShardedObject``\\ s: the
``rng_state``, Transformer Engine's ``_extra_state``, megatron-core 0.19's ``common_state``) is a ``torch.save``
record in a ``__*.distcp`` file, which torch's ``DefaultLoadPlanner.load_bytes`` reads with
``torch.load(weights_only=False)`` on every supported stack (torch 2.10 to 2.14): a planted one runs its code on
resume. :func:`vet_checkpoint` vets each of them too, from the byte range ``.metadata`` gives.
:func:`load_metadata` then reads ``.metadata`` itself, resolving only allowed classes.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["ALLOWED", "load_metadata", "pickle_files", "vet_checkpoint", "vet_pickle"]

_DCP = "torch.distributed.checkpoint"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    # torch DCP's .metadata (torch/distributed/checkpoint/metadata.py, filesystem.py, planner.py)
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    *((f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("torch", "device"),
    # torch.save files (what torch.load(weights_only=True) takes)
    ("collections", "OrderedDict"), ("_codecs", "encode"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"),
    # the rng_state object (numpy's RNG state: an array), in a DCP bytes item; numpy >= 2 and < 2 module names
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("_io", "BytesIO"),  # Transformer Engine's _extra_state as older TE releases saved it
})
# A DCP bytes item larger than this is not one of megatron-core's objects (the largest, common_state and
# rng_state, are kilobytes); refused before it is read into memory.
_MAX_OBJECT_BYTES = 64 << 20


def _torch_type(module: str, name: str) -> bool:
    """``torch.float32`` and the other dtypes, ``torch.FloatStorage`` and the other typed storages."""
    if module != "torch" or not name.isidentifier():
        return False
    import torch

    value = getattr(torch, name, None)
    return isinstance(value, torch.dtype) or (name.endswith("Storage") and isinstance(value, type))


class _Inert:
    """What every allowed global becomes while vetting: builds, calls, fills and sets state without running
    anything of the class it stands for."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Refused(Exception):
    pass


@functools.cache
def _stand_in(module: str, name: str) -> type:
    return type(name, (_Inert,), {"__module__": module})


class _Vetting(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or _torch_type(module, name):
            return _stand_in(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:  # torch.save's storages: their bytes are not read
        return _Inert()


class _Loading(pickle.Unpickler):
    """Resolves only allowed globals, to the real ones: ``.metadata`` read without a global outside the list."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or _torch_type(module, name):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


@functools.lru_cache(maxsize=4)
def _load_metadata(path: str, size: int, mtime_ns: int) -> Any:
    with open(path, "rb") as stream:
        return _Loading(stream).load()


def load_metadata(iter_dir: str | Path) -> Any:
    """torch DCP's ``Metadata`` of ``iter_dir`` (what ``FileSystemReader.read_metadata`` returns), unpickled with
    only allowed classes resolved; ``UserError`` naming the file otherwise. Cached per file version: the vetting,
    the integrity check and the streaming export read it once (48 MB, seconds, at Kimi K2's real layout)."""
    path = Path(iter_dir) / ".metadata"
    try:
        stat = path.stat()
        metadata = _load_metadata(str(path), stat.st_size, stat.st_mtime_ns)
    except _Refused as exc:
        raise UserError(f"{path} names {exc}, which no checkpoint holds: refused, nothing of it was run "
                        "(a checkpoint from someone else may carry code; use checkpoints you trust)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc}); the checkpoint is damaged") from None
    except Exception as exc:
        raise UserError(f"{path} is not a readable pickle ({type(exc).__name__}: {exc}); the checkpoint "
                        "is damaged") from None
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict) or \
            not isinstance(getattr(metadata, "storage_data", None) or {}, dict):
        raise UserError(f"{path} holds a {type(metadata).__name__}, not torch DCP metadata; the checkpoint is damaged")
    return metadata


def vet_pickle(path: Path) -> None:
    """``UserError`` unless every pickle in ``path`` (a pickle, or a torch.save zip) names only allowed globals."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for member in (m for m in archive.namelist() if m.endswith(".pkl")):
                    _vet_stream(io.BytesIO(archive.read(member)), path, f" ({member})")
        else:
            with path.open("rb") as stream:
                _vet_stream(stream, path, "")
    except (OSError, zipfile.BadZipFile) as exc:
        raise UserError(f"{path}: cannot be read ({exc}); the checkpoint is damaged") from None


def _vet_stream(stream: Any, path: Path, member: str) -> None:
    try:
        _Vetting(stream).load()
    except _Refused as exc:
        raise UserError(f"{path}{member} names {exc}, which no checkpoint holds: refused, nothing of it was run "
                        "(a checkpoint from someone else may carry code; use checkpoints you trust)") from None
    except Exception as exc:  # truncated, bit-flipped, not a pickle at all
        raise UserError(f"{path}{member} is not a readable pickle ({type(exc).__name__}: {exc}); the checkpoint "
                        "is damaged") from None


# The root's pickle a load reads: Megatron Bridge's tracker. Not the layer-wise optimizer's per-rank
# ``layer_wise_optimizer_<dp rank>.pt`` that megatron-bridge 0.3 also writes there on every save: with torch_dist
# it is never loaded (0.6 writes it for local checkpoints only), and a running save rewrites it in place.
_ROOT_PICKLES = ("latest_train_state.pt",)


def pickle_files(iter_dir: Path, root: Path | None = None) -> list[Path]:
    """The pickles a load of ``iter_dir`` reads: its ``.metadata``, ``*.pt`` and ``*.pkl`` (any depth), and the
    root's tracker."""
    files = sorted(p for p in iter_dir.rglob("*") if p.is_file() and (p.name == ".metadata" or p.suffix in
                                                                        (".pt", ".pkl")))
    if root is not None and root.is_dir() and root != iter_dir:
        files += [root / name for name in _ROOT_PICKLES if (root / name).is_file()]
    return files


def vet_checkpoint(iter_dir: str | Path, root: str | Path | None = None) -> None:
    """Vet every pickle of one iteration (and its root's, see :func:`pickle_files`); ``UserError`` on the first
    that names a global outside :data:`ALLOWED` or cannot be read."""
    for path in pickle_files(Path(iter_dir), Path(root) if root is not None else None):
        vet_pickle(path)
    if (Path(iter_dir) / ".metadata").is_file():
        _vet_stored_objects(Path(iter_dir))


def _vet_stored_objects(iter_dir: Path) -> None:
    """The ``torch.save`` record of every DCP bytes item (a ``ShardedObject``) in the data files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = load_metadata(iter_dir)
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = iter_dir / info.relative_path
        where = f" (the object {index.fqn} at byte {info.offset})"
        if not 0 <= info.length <= _MAX_OBJECT_BYTES:
            raise UserError(f"{path}{where}: .metadata says it is {info.length} bytes; megatron-core's objects are "
                            "kilobytes: refused (the checkpoint is damaged or not a Megatron checkpoint)")
        try:
            with path.open("rb") as stream:
                data = os.pread(stream.fileno(), info.length, info.offset)
        except FileNotFoundError:
            continue  # nothing to run: the integrity check names the missing file
        except OSError as exc:
            raise UserError(f"{path}: cannot be read ({exc}); the checkpoint is damaged") from None
        if len(data) != info.length:
            continue  # cut short, it cannot be loaded: the integrity check names the damage
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                members = [(m, archive.read(m)) for m in archive.namelist() if m.endswith(".pkl")]
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise UserError(f"{path}{where} is not a torch.save record ({exc}); the checkpoint is damaged") from None
        for member, pickled in members:
            _vet_stream(io.BytesIO(pickled), path, f"{where[:-1]}, {member})")
