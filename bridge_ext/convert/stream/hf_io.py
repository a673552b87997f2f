"""Hugging Face safetensors read by byte range: a private memory map of that range per tensor, unmapped with the
tensor, so memory holds only the tensors in flight.

Format: 8-byte little-endian header length, a JSON header (dtype, shape, ``data_offsets`` relative to the data
section), then the data (https://github.com/huggingface/safetensors#format). The directory itself was validated
by :func:`bridge_ext.hf.directory.inspect_hf_dir` (sizes, truncation, index); here only the offsets are read.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bridge_ext.hf.directory import SAFETENSORS_DTYPES, HFSource
from bridge_ext.hf.int4 import read_int4
from bridge_ext.runtime import map_range

__all__ = ["HFByteReader", "LazyHFState", "ST_TO_TORCH"]

# safetensors dtype code -> torch dtype name
ST_TO_TORCH = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip


def _data_offsets(file: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where the data section of ``file`` starts and each tensor's byte range in it."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return 8 + length, {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


class HFByteReader:
    """Tensors of a validated HF directory by stored name, or by per-expert name where the checkpoint fuses its
    routed experts (transformers 5: one expert's rows of ``gate_up_proj`` / ``down_proj`` are one contiguous byte
    range, read alone). Thread-safe: ``pread`` has no file position."""

    def __init__(self, source: HFSource):
        self.source = source
        self._fds: dict[str, int] = {}
        self._where: dict[str, tuple[str, int]] = {}  # stored name -> (file, absolute offset)
        for file in source.files:
            base, offsets = _data_offsets(source.path / file)
            for name, (begin, _) in offsets.items():
                self._where[name] = (file, base + begin)
        self.names: list[str] = source.readable()
        self._lock = threading.Lock()

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.source.path / file, os.O_RDONLY)
            return self._fds[file]

    def nbytes(self, name: str) -> int:
        """Bytes ``name`` occupies on disk (a per-expert view: its part of the fused tensor)."""
        view = self.source.expert_views.get(name)
        if view is None:
            return self.source.tensors[name].nbytes
        info = self.source.tensors[view.fused]
        rows = view.rows or (0, info.shape[1])
        return (rows[1] - rows[0]) * math.prod(info.shape[2:]) * SAFETENSORS_DTYPES[info.dtype]

    def read(self, name: str) -> Any:
        """The tensor ``name`` as stored (dtype and shape), an int4 weight dequantized; KeyError when the checkpoint
        has none."""
        import torch

        if name in self.source.int4_weights:
            return read_int4(name, self.read, self.source.int4, getattr(torch, self.source.dtype))
        view = self.source.expert_views.get(name)
        stored = view.fused if view is not None else name
        if stored not in self.source.tensors:
            raise KeyError(name)
        info = self.source.tensors[stored]
        file, offset = self._where[stored]
        shape: tuple[int, ...] = info.shape
        if view is not None:  # expert n, rows r0:r1 of [E, R, C]: contiguous from (n * R + r0) * C elements
            rows = view.rows or (0, info.shape[1])
            row_bytes = math.prod(info.shape[2:]) * SAFETENSORS_DTYPES[info.dtype]
            offset += (view.expert * info.shape[1] + rows[0]) * row_bytes
            shape = (rows[1] - rows[0], *info.shape[2:])
        dtype = getattr(torch, ST_TO_TORCH[info.dtype])
        return map_range(self._fd(file), offset, math.prod(shape) * SAFETENSORS_DTYPES[info.dtype], dtype, shape)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class LazyHFState(Mapping):
    """The HF state Megatron Bridge's hooks read (``maybe_modify_loaded_hf_weight(hf_param, state)``: a mapping
    name -> tensor): each lookup reads the tensor from disk, nothing is cached."""

    def __init__(self, reader: HFByteReader):
        self._reader = reader
        self._names = frozenset(reader.names)

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._reader.read(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._reader.names)

    def __len__(self) -> int:
        return len(self._names)
