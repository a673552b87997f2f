"""torch_dist checkpoints (megatron-core dist-checkpointing over torch DCP) written and read tensor by tensor.

What megatron-core's ``TorchDistSaveShardedStrategy`` writes, and this module writes the same way:

* ``.metadata``: a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key (a ``ShardedTensor.key``,
  e.g. ``decoder.layers.self_attention.linear_qkv.weight``) the *global* shape and dtype and the chunks it is
  stored in (offsets and sizes in the global tensor), and per chunk where its bytes are (file, offset,
  length); ``ShardedObject``\\ s (``_extra_state``; megatron-core 0.19's ``common_state``) under their
  ``unique_key`` as bytes.
* ``__<rank>_<n>.distcp``: each chunk as ``torch.save`` of the chunk tensor (shape: ``(1,) * prepend_axis_num +
  local_shape``), each object as ``torch.save([data])`` (``mcore_to_pyt_state_dict``), back to back; torch's
  ``FileSystemReader`` reads a chunk by ``torch.load`` of its byte range.
* ``metadata.json`` and the common state (``common.pt`` up to megatron-core 0.18, a ``common_state`` object from
  0.19) are written by megatron-core's own ``dist_checkpointing.save``, which calls the strategy below for the
  sharded part only; Megatron Bridge's ``save_checkpoint`` adds ``run_config.yaml``, ``train_state.pt`` and
  the tracker.

Because the keys hold global tensors with their chunking, a checkpoint written from a one-process skeleton
loads in any layout (DCP reads the overlap of each rank's shard with the stored chunks).
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
import uuid
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge_ext.convert.stream.skeleton import NeedsModel, Skeleton
from bridge_ext.errors import UserError

__all__ = ["Chunk", "TorchDistChunks", "make_strategy", "missing_stored_file", "plan_chunks"]

_METADATA = ".metadata"


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a parameter: the checkpoint key, where it sits in the global tensor, and which part
    of the parameter it is (``as_strided`` arguments on the parameter's contiguous value)."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # the stored tensor's shape: (1,) * prepend_axis_num + local_shape
    dtype: Any
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset within the parameter


def plan_chunks(sharded: Iterable[Any], skeleton: Skeleton) -> tuple[dict[tuple[int, str], list[Chunk]], list[Any]]:
    """Group the ``ShardedTensor``\\ s of a (factories applied) sharded state dict by the parameter they view, one per
    (key, offset); return them and the main-replica ``ShardedObject``\\ s.

    Every chunk counts whatever its ``replica_id``: under torchrun each process holds the whole one-process
    skeleton (a data-parallel replica, main only on rank 0), and the writers split the parameters among
    themselves."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

    groups: dict[tuple[int, str], list[Chunk]] = {}
    seen: dict[tuple[str, tuple[int, ...]], Any] = {}
    objects = []
    for item in sharded:
        if isinstance(item, ShardedObject):
            if is_main_replica(item.replica_id):
                objects.append(item)
            continue
        if not isinstance(item, ShardedTensor):
            raise NeedsModel(f"checkpoint entry {getattr(item, 'key', item)!r} is a {type(item).__name__}")
        if item.flattened_range is not None:
            raise NeedsModel(f"{item.key} is stored flattened (a distributed-optimizer layout)")
        data = item.data
        owner = skeleton.owner_of(data)
        chunk = Chunk(
            key=item.key, global_shape=tuple(item.global_shape), offsets=tuple(item.global_offset),
            sizes=(1,) * item.prepend_axis_num + tuple(item.local_shape), dtype=item.dtype,
            view=(tuple(data.shape), tuple(data.stride()), data.storage_offset()),
        )  # fmt: skip
        if (chunk.key, chunk.offsets) in seen:
            if seen[(chunk.key, chunk.offsets)] != (owner, chunk.view):
                raise NeedsModel(f"{chunk.key} at {list(chunk.offsets)} is stored from two different tensors")
            continue
        seen[(chunk.key, chunk.offsets)] = (owner, chunk.view)
        groups.setdefault(owner, []).append(chunk)
    return groups, objects


def _chunk_value(value: Any, chunk: Chunk) -> Any:
    """The chunk's part of the parameter's value as a tensor whose storage is exactly that part: ``torch.save``
    writes a tensor's whole storage, so a view (e.g. one half of a gated ``linear_fc1``) is re-based onto the slice
    of the storage it covers (shared memory, no copy)."""
    import torch

    size, stride, offset = chunk.view
    piece = value.as_strided(size, stride, offset).reshape(chunk.sizes).contiguous()
    nbytes = piece.numel() * piece.element_size()
    if piece.untyped_storage().nbytes() == nbytes:
        return piece
    start = piece.storage_offset() * piece.element_size()
    part = piece.untyped_storage()[start : start + nbytes]
    return torch.empty(0, dtype=piece.dtype).set_(part, 0, piece.shape, piece.stride())


class _Recorder:
    """Storage records of the chunks and objects written, to build ``.metadata``."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[tuple[int, ...], Any, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
        self.objects: list[str] = []
        self.storage: list[tuple[str, tuple[int, ...] | None, str, int, int]] = []
        self._lock = threading.Lock()

    def tensor(self, chunk: Chunk, file: str, offset: int, length: int) -> None:
        with self._lock:
            entry = self.tensors.setdefault(chunk.key, (chunk.global_shape, chunk.dtype, []))
            entry[2].append((chunk.offsets, chunk.sizes))
            self.storage.append((chunk.key, chunk.offsets, file, offset, length))

    def obj(self, key: str, file: str, offset: int, length: int) -> None:
        with self._lock:
            self.objects.append(key)
            self.storage.append((key, None, file, offset, length))

    def records(self) -> tuple[Any, ...]:
        return self.tensors, self.objects, self.storage

    def merge(self, records: tuple[Any, ...]) -> None:
        tensors, objects, storage = records
        for key, (shape, dtype, chunks) in tensors.items():
            self.tensors.setdefault(key, (shape, dtype, []))[2].extend(chunks)
        self.objects += objects
        self.storage += storage

    def metadata(self, checkpoint_dir: Path) -> Any:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo  # the record type of .metadata
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        state: dict[str, Any] = {}
        for key, (shape, dtype, chunks) in self.tensors.items():
            state[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in sorted(chunks)],
            )  # fmt: skip
        for key in self.objects:
            state[key] = BytesStorageMetadata()
        storage = {
            MetadataIndex(fqn=key, offset=None if offsets is None else torch.Size(offsets)): _StorageInfo(
                relative_path=file, offset=offset, length=length)
            for key, offsets, file, offset, length in self.storage
        }  # fmt: skip
        meta = StorageMeta(checkpoint_id=str(checkpoint_dir), save_id=str(uuid.uuid4()))
        return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=meta)


def _save_to(handle: Any, value: Any) -> tuple[int, int]:
    import torch

    start = handle.tell()
    torch.save(value, handle)
    return start, handle.tell() - start


def make_strategy(*, skeleton: Skeleton, produce: Callable[[tuple[int, str]], Any], threads: int,
                  done: Callable[[tuple[int, str], int], None] | None = None) -> Any:
    """A megatron-core ``TorchDistSaveShardedStrategy`` (megatron-core 0.19's ``dist_checkpointing.save`` replaces any
    other class by its own) whose ``save`` writes each chunk from ``produce(owner)`` -- the full value of one
    parameter, converted from HF tensors -- instead of from a model. Passed to Megatron Bridge's
    ``save_checkpoint`` as ``checkpointing_context["save_strategy"]``.

    Work: ``threads`` writers, each pulling the next parameter, converting it and appending its chunks to its
    own ``__<rank>_<n>.distcp``; under torchrun, rank r takes every world-th parameter and rank 0 writes
    ``.metadata`` from everyone's records. At most ``threads`` parameters are in memory at once. ``done(owner,
    nbytes)`` is called after each parameter.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class _Strategy(TorchDistSaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("torch_dist", 1)
            self.chunks_written = 0

        def async_save(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the streaming conversion saves synchronously")

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            groups, objects = plan_chunks(nested_values(sharded_state_dict), skeleton)
            missing = [key for key in skeleton.params if key not in groups]
            if missing:
                raise NeedsModel(f"{missing[0][1]} has no place in the checkpoint ({len(missing)} parameters)")
            self.chunks_written = _write(Path(checkpoint_dir), groups, objects, produce, threads=threads, done=done)

    return _Strategy()


def _write(directory: Path, groups: dict[tuple[int, str], list[Chunk]], objects: list[Any],
           produce: Callable[[tuple[int, str]], Any], *, threads: int,
           done: Callable[[tuple[int, str], int], None] | None) -> int:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    owners = list(groups)[rank::world]
    recorder = _Recorder()
    queue = iter(owners)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(n: int) -> None:
        name = f"__{rank}_{n}.distcp"
        with open(directory / name, "wb") as handle:
            if n == 0 and rank == 0:
                for obj in objects:  # megatron-core: torch.save of the list of same-key objects' data
                    buffer = io.BytesIO()
                    torch.save([obj.data], buffer)
                    start = handle.tell()
                    handle.write(buffer.getbuffer())
                    recorder.obj(obj.unique_key, name, start, handle.tell() - start)
            while not errors:
                with lock:
                    owner = next(queue, None)
                if owner is None:
                    return
                value = produce(owner).contiguous()
                nbytes = 0
                for chunk in groups[owner]:
                    piece = _chunk_value(value, chunk)
                    start, length = _save_to(handle, piece)
                    recorder.tensor(chunk, name, start, length)
                    nbytes += piece.numel() * piece.element_size()
                del value
                if done is not None:
                    done(owner, nbytes)

    def guarded(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    count = max(1, min(threads, len(owners)))
    if count == 1:
        work(0)
    else:
        pool = [threading.Thread(target=guarded, args=(n,), name=f"torch-dist-writer-{n}") for n in range(count)]
        for thread in pool:
            thread.start()
        try:
            for thread in pool:
                thread.join()
        except BaseException as exc:  # Ctrl-C / SIGTERM (SystemExit) in this thread: the writers stop at their next
            errors.append(exc)  # parameter instead of finishing the conversion into a directory being removed
            raise
        if errors:
            raise errors[0]
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, recorder.records())
        if rank == 0:
            for other in gathered[1:]:
                recorder.merge(other)
    if rank == 0:
        tmp = directory / f"{_METADATA}.tmp"
        with open(tmp, "wb") as handle:
            pickle.dump(recorder.metadata(directory), handle)
        os.replace(tmp, directory / _METADATA)
    if world > 1:
        dist.barrier()
    return len(recorder.storage)


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
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = directory
        self.metadata = FileSystemReader(str(directory)).read_metadata()
        self._where = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
                       for index, info in self.metadata.storage_data.items()}  # fmt: skip
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

    def _file_problem(self, key: str, offsets: tuple[int, ...], info: Any) -> str | None:
        size = self._file_size(info.relative_path)
        if size is None:
            return f"{self.directory / info.relative_path} is missing (it holds {key} at {list(offsets)})"
        if size < info.offset + info.length:
            return (f"{self.directory / info.relative_path} is {size} bytes, shorter than .metadata says "
                    f"({key} at {list(offsets)} ends at byte {info.offset + info.length})")  # fmt: skip
        return None

    def missing_file(self) -> str | None:
        """The first file of a model tensor (optimizer state aside) that is missing or shorter than ``.metadata``
        says, naming the tensor, or None: one ``stat`` per file."""
        for (key, offsets), info in self._where.items():
            if offsets is not None and not key.startswith("optimizer."):
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
            where = self.directory / info.relative_path if info is not None else self.directory / _METADATA
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{where}: cannot read {key} at {list(offsets)} ({cause})") from None

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...] | None = None, dtype: Any = None) -> Any:
        """The stored chunk of ``key`` at ``offsets``: where it is a plain contiguous tensor of ``sizes`` and ``dtype``
        (what megatron-core and this module write), its bytes mapped in place (no copy); otherwise as torch's
        ``FileSystemReader`` reads it, ``torch.load`` of the byte range. The file is opened for this one read
        (the map keeps its own reference): a checkpoint saved by 1,000 ranks has 2,000 files, more than a
        process may hold open, and an open costs microseconds against a chunk's megabytes."""
        import torch

        from bridge_ext.convert.stream.hf_io import map_range

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
    except (OSError, EOFError, ValueError, AttributeError, pickle.UnpicklingError):  # no readable .metadata
        return None
    return chunks.missing_file()
