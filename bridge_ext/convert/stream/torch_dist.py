"""torch_dist checkpoints (megatron-core dist-checkpointing over torch DCP) written tensor by tensor; read region by
region with :class:`bridge_ext.checkpoints.torch_dist.TorchDistChunks`.

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

import io
import pickle
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge_ext.checkpoints.torch_dist import METADATA
from bridge_ext.convert.stream.skeleton import NeedsModel, Skeleton
from bridge_ext.runtime import write_atomic

__all__ = ["Chunk", "make_strategy", "plan_chunks"]


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
        write_atomic(directory / METADATA, pickle.dumps(recorder.metadata(directory)))
    if world > 1:
        dist.barrier()
    return len(recorder.storage)
