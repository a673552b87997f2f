"""Reading Megatron's torch_dist checkpoints (megatron-core dist-checkpointing over torch DCP) region by region.

What megatron-core's ``TorchDistSaveShardedStrategy`` writes (``bridge_ext.convert.stream.torch_dist`` writes it
the same way):

* ``.metadata``: a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key (a ``ShardedTensor.key``,
  e.g. ``decoder.layers.self_attention.linear_qkv.weight``) the *global* shape and dtype and the chunks it is
  stored in (offsets and sizes in the global tensor), and per chunk where its bytes are (file, offset,
  length); ``ShardedObject``\\ s (``_extra_state``; megatron-core 0.19's ``common_state``) under their
  ``unique_key`` as bytes.
* ``__<rank>_<n>.distcp``: each chunk as ``torch.save`` of the chunk tensor, each object as ``torch.save([data])``,
  back to back; torch's ``FileSystemReader`` reads a chunk by ``torch.load`` of its byte range.

Because the keys hold global tensors with their chunking, any region of a stored tensor can be read in another
layout's chunking (:class:`TorchDistChunks`): what the streaming export and the shard checks read.
"""

from __future__ import annotations

import bisect
import collections
import io
import math
import os
import pickle
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.runtime import map_range

__all__ = ["METADATA", "TorchDistChunks", "missing_stored_file"]

METADATA = ".metadata"


class _FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream (``torch.load`` reads one chunk)."""

    def __init__(self, fd: int, offset: int, length: int):
        self._fd, self._base, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = pos if whence == io.SEEK_SET else self._pos + pos if whence == io.SEEK_CUR else self._length + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._length - self._pos)
        if want <= 0:
            return 0
        got = os.preadv(self._fd, [memoryview(buffer)[:want]], self._base + self._pos)
        self._pos += got
        return got


class _TensorRecord(pickle.Unpickler):
    """Reads the ``data.pkl`` of one ``torch.save``-d tensor without loading anything: the storage it names and
    ``_rebuild_tensor_v2``'s arguments. Anything else in the pickle (another class, a second storage) raises, and
    the chunk is read by ``torch.load``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ('storage', storage type, key, location, numel)


def _stored_tensor_range(fd: int, offset: int, length: int, sizes: tuple[int, ...], element: int) -> int | None:
    """Where, in the file, the data of a ``torch.save``-d contiguous tensor of ``sizes`` starts -- or None when the
    record is anything else (then ``torch.load`` reads it). torch.save writes a zip of ``<name>/data.pkl`` and
    ``<name>/data/<key>`` records, stored uncompressed (``torch/serialization.py``)."""
    with zipfile.ZipFile(io.BufferedReader(_FileSlice(fd, offset, length))) as archive:
        infos = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in infos if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            return None
        try:
            storage, storage_offset, size, stride = _TensorRecord(io.BytesIO(archive.read(pickles[0]))).load()
        except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError):
            return None
    contiguous = tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
    if size != sizes or storage_offset != 0 or (stride != contiguous and math.prod(size) > 1):
        return None
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage"):
        return None
    record = infos.get(f"{pickles[0][: -len('data.pkl')]}data/{storage[2]}")
    if record is None or record.compress_type != zipfile.ZIP_STORED or record.file_size != math.prod(size) * element:
        return None
    header = os.pread(fd, 30, offset + record.header_offset)  # the local file header: name and extra lengths
    if header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return offset + record.header_offset + 30 + name_length + extra_length


class _ChunkIndex:
    """The stored chunks of one key, nested by their start on each axis, so that the chunks overlapping a region
    are found without scanning them all: a checkpoint saved at Kimi K2's TP2 x EP32 x PP16 stores its routed
    experts' ``linear_fc1`` as 60 layers x 384 experts x 2 halves x 2 TP pieces = 92,160 chunks under one key, and
    the export asks for 46,080 regions of it. A query walks one sorted list per axis (bisect), so it costs the
    chunks it finds, not the key's."""

    def __init__(self, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]):
        self._ndim = len(chunks[0][0]) if chunks else 0
        self._root = self._build(chunks, 0) if chunks else None

    def _build(self, chunks: list[Any], axis: int) -> Any:
        if axis == self._ndim:
            return chunks
        by_start: dict[int, list[Any]] = {}
        for chunk in chunks:
            by_start.setdefault(chunk[0][axis], []).append(chunk)
        starts = sorted(by_start)
        longest = max(chunk[1][axis] for chunk in chunks)
        return starts, longest, [self._build(by_start[start], axis + 1) for start in starts]

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Any]:
        """The stored (offsets, sizes) that share at least one element with the region."""
        found: list[Any] = []
        if self._root is not None and all(sizes):
            self._walk(self._root, 0, offsets, sizes, found)
        return found

    def _walk(self, node: Any, axis: int, offsets: tuple[int, ...], sizes: tuple[int, ...], found: list[Any]) -> None:
        if axis == self._ndim:
            found.extend(c for c in node if all(o < e + s and e < o + z for o, z, e, s in zip(
                offsets, sizes, c[0], c[1])))  # fmt: skip
            return
        starts, longest, children = node
        low = bisect.bisect_right(starts, offsets[axis] - longest)  # a chunk starting there or before ends before
        high = bisect.bisect_left(starts, offsets[axis] + sizes[axis])
        for child in children[low:high]:
            self._walk(child, axis + 1, offsets, sizes, found)


def _intersection(offsets: tuple[int, ...], sizes: tuple[int, ...], other_offsets: tuple[int, ...],
                  other_sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Start and end (global coordinates) of two boxes' common part."""
    start = tuple(max(a, b) for a, b in zip(offsets, other_offsets))
    end = tuple(min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, other_offsets, other_sizes))
    return start, end


class TorchDistChunks:
    """The chunks of a torch_dist checkpoint, and any region of a stored tensor read from whichever chunks hold it.

    torch DCP stores each key as the chunks of the layout that saved it (TP slices, expert shards, pipeline
    stages' layers, ...) at their offsets in the global tensor; a region in another layout's chunking (the one a
    one-process skeleton asks for) is copied together from the stored chunks it overlaps -- what DCP's own
    planner does when it loads into another layout (``torch/distributed/checkpoint/default_planner.py``,
    ``create_read_items_for_chunk_list``), here one region at a time, reading only the chunks that overlap it."""

    def __init__(self, directory: Path):
        from bridge_ext.checkpoints.pickles import load_metadata

        self.directory = directory
        self.metadata = load_metadata(directory)  # FileSystemReader.read_metadata, with only allowed classes
        self._where = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
                       for index, info in (self.metadata.storage_data or {}).items()}  # fmt: skip
        self._sizes: dict[str, int | None] = {}
        self._indexes: dict[str, _ChunkIndex] = {}
        self._lock = threading.Lock()

    def global_shape(self, key: str) -> tuple[int, ...] | None:
        meta = self.metadata.state_dict_metadata.get(key)
        return tuple(meta.size) if meta is not None and hasattr(meta, "size") else None

    def has(self, key: str, offsets: tuple[int, ...]) -> bool:
        return (key, offsets) in self._where

    def _index(self, key: str) -> _ChunkIndex:
        with self._lock:
            if key not in self._indexes:
                chunks = self.metadata.state_dict_metadata[key].chunks
                self._indexes[key] = _ChunkIndex([(tuple(c.offsets), tuple(c.sizes)) for c in chunks])
            return self._indexes[key]

    def overlapping(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Any]:
        """The stored chunks of ``key`` (offsets, sizes) that overlap the region ``offsets`` + ``sizes``."""
        return self._index(key).overlapping(offsets, sizes)

    def file_of(self, key: str, offsets: tuple[int, ...]) -> str:
        return self._where[(key, offsets)].relative_path

    def check_region(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str | None:
        """Why the region cannot be read (its elements not all stored, a chunk's file missing or shorter than the
        metadata says), or None. Stored chunks of one key do not overlap (DCP's save plan validation), so the
        region is covered when the volumes of its intersections add up to its own."""
        covered = 0
        for stored_offsets, stored_sizes in self.overlapping(key, offsets, sizes):
            start, end = _intersection(offsets, sizes, stored_offsets, stored_sizes)
            covered += math.prod(e - s for s, e in zip(start, end))
            info = self._where.get((key, stored_offsets))
            if info is None:
                return f"{key}: .metadata lists a chunk at {list(stored_offsets)} with no storage record"
            problem = self._file_problem(key, stored_offsets, info)
            if problem is not None:
                return problem
        if covered != math.prod(sizes):
            return (f"{key} stores {covered} of the {math.prod(sizes)} elements of the region at {list(offsets)} "
                    f"of size {list(sizes)}")  # fmt: skip
        return None

    def _file_problem(self, key: str, offsets: tuple[int, ...] | None, info: Any) -> str | None:
        size = self._file_size(info.relative_path)
        where = key if offsets is None else f"{key} at {list(offsets)}"
        if size is None:
            return f"{self.directory / info.relative_path} is missing (it holds {where})"
        if size < info.offset + info.length:
            return (f"{self.directory / info.relative_path} is {size} bytes, shorter than .metadata says "
                    f"({where} ends at byte {info.offset + info.length})")  # fmt: skip
        return None

    def missing_file(self, *, optimizer: bool = False, objects: bool = False) -> str | None:
        """The first file of a model tensor (``optimizer``: optimizer state too; ``objects``: the stored objects
        too) that is missing or shorter than ``.metadata`` says, naming the tensor, or None: one ``stat`` per
        file."""
        for (key, offsets), info in self._where.items():
            if (offsets is not None or objects) and (optimizer or not key.startswith("optimizer.")):
                problem = self._file_problem(key, offsets, info)
                if problem is not None:
                    return problem
        return None

    def _file_size(self, file: str) -> int | None:
        with self._lock:
            if file not in self._sizes:
                try:
                    self._sizes[file] = os.stat(self.directory / file).st_size
                except FileNotFoundError:
                    self._sizes[file] = None
            return self._sizes[file]

    def read_region(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], *, into: Any = None) -> Any:
        """The region ``offsets`` + ``sizes`` of ``key``'s global tensor. Where one stored chunk is exactly the region:
        that chunk (mapped in place, no copy; ``into`` is then filled from it if given). Otherwise each overlapping
        stored chunk is read and its intersection with the region copied into ``into`` (a tensor of the region's
        elements, any view of them; a new one when None). Memory: the region, plus the stored chunks overlapping it,
        which are mapped from the page cache. A chunk that cannot be read raises a one-line ``UserError`` naming its
        file and the tensor."""
        import torch

        dtype = self.dtype(key)
        found = self.overlapping(key, offsets, sizes)
        if len(found) == 1 and found[0] == (offsets, sizes):
            whole = self._read_stored(key, offsets, sizes, dtype)
            if into is None:
                return whole
            into.copy_(whole.reshape(into.shape))
            return into
        value = torch.empty(sizes, dtype=dtype) if into is None else into
        region = value.view(sizes)  # adds or drops the leading size-1 (prepended) axes only
        for stored_offsets, stored_sizes in found:
            start, end = _intersection(offsets, sizes, stored_offsets, stored_sizes)
            stored = self._read_stored(key, stored_offsets, stored_sizes, dtype)
            region[tuple(slice(s - o, e - o) for s, e, o in zip(start, end, offsets))].copy_(
                stored.reshape(stored_sizes)[tuple(slice(s - o, e - o) for s, e, o in zip(start, end, stored_offsets))])
            del stored
        return value

    def _read_stored(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: Any) -> Any:
        try:
            return self.read(key, offsets, sizes, dtype)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
            info = self._where.get((key, offsets))
            where = self.directory / info.relative_path if info is not None else self.directory / METADATA
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{where}: cannot read {key} at {list(offsets)} ({cause})") from None

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...] | None = None, dtype: Any = None) -> Any:
        """The stored chunk of ``key`` at ``offsets``: where it is a plain contiguous tensor of ``sizes`` and ``dtype``
        (what megatron-core and this module write), its bytes mapped in place (no copy); otherwise as torch's
        ``FileSystemReader`` reads it, ``torch.load`` of the byte range. The file is opened for this one read
        (the map keeps its own reference): a checkpoint saved by 1,000 ranks has 2,000 files, more than a
        process may hold open, and an open costs microseconds against a chunk's megabytes."""
        import torch

        info = self._where[(key, offsets)]
        fd = os.open(self.directory / info.relative_path, os.O_RDONLY)
        try:
            if sizes is not None and dtype is not None and not getattr(info, "transform_descriptors", None):
                element = torch.empty((), dtype=dtype).element_size()
                start = _stored_tensor_range(fd, info.offset, info.length, sizes, element)
                if start is not None:
                    return map_range(fd, start, math.prod(sizes) * element, dtype, sizes)
            stream = _FileSlice(fd, info.offset, info.length)
            return torch.load(io.BufferedReader(stream, buffer_size=1 << 16), map_location="cpu", weights_only=True)
        finally:
            os.close(fd)

    def dtype(self, key: str) -> Any:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def close(self) -> None:
        """Nothing stays open between reads; kept for callers that close what they open."""


def missing_stored_file(directory: Path) -> str | None:
    """The first model tensor's file of the torch_dist checkpoint ``directory`` that is missing or short, as one
    line naming the file and the tensor; None when every file is there (or ``.metadata`` itself cannot be read,
    which the caller reports)."""
    try:
        chunks = TorchDistChunks(Path(directory))
    except UserError:  # no readable .metadata: the caller reports it
        return None
    return chunks.missing_file()
