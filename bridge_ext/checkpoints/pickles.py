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
``collections.OrderedDict``, ``_codecs.encode`` for bytes).
"""

from __future__ import annotations

import functools
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError

__all__ = ["ALLOWED", "pickle_files", "vet_checkpoint", "vet_pickle"]

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
})


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
