"""Streaming export: a Megatron torch_dist checkpoint -> Hugging Face tensors, parameter by parameter, without
building the model (``nemo llm export``'s default path).

The skeleton (:mod:`~bridge_ext.convert.stream.skeleton`) is built for the checkpoint's HF config; its sharded
state dict -- made with the checkpoint's own content metadata (``load_content_metadata``: e.g. how experts are
keyed), as megatron-core's loader makes it -- says which stored chunks hold each parameter. Each parameter is
assembled from its chunks (:class:`~bridge_ext.checkpoints.torch_dist.TorchDistChunks`) and handed to Megatron
Bridge's own export loop, ``stream_weights_megatron_to_hf`` with ``conversion_tasks`` whose ``param_weight`` is
that value (the loop reads ``task.param_weight``; with no progress bar it iterates the tasks lazily): the
mappings' ``megatron_to_hf`` (QKV split, gate|up split, MLA, experts), the bridge's
``maybe_modify_converted_hf_weight``, tied embeddings and grouped exports are upstream's. The next parameters
are read ahead by ``threads`` readers; memory is those parameters and the one being written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bridge_ext.checkpoints.torch_dist import TorchDistChunks
from bridge_ext.convert.stream.skeleton import NeedsModel, Skeleton, build_skeleton
from bridge_ext.convert.stream.torch_dist import Chunk, plan_chunks
from bridge_ext.errors import UserError

__all__ = ["export_streaming_into"]


def _sharded_chunks(skeleton: Skeleton, iter_dir: Path) -> dict[tuple[int, str], list[Chunk]]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.utils import unwrap_model

    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    groups: dict[tuple[int, str], list[Chunk]] = {}
    for module in unwrap_model(skeleton.model):
        sharded = module.sharded_state_dict(metadata=metadata)
        apply_factories(sharded)
        found, _ = plan_chunks(nested_values(sharded), skeleton)
        groups.update(found)
    missing = [key for key in skeleton.tasks if key not in groups]
    if missing:
        raise NeedsModel(f"{missing[0][1]} has no place in the checkpoint's sharded state dict")
    return groups


def _check_stored(chunks: TorchDistChunks, groups: dict[tuple[int, str], list[Chunk]], *, iter_dir: Path,
                  hf_source: Path) -> None:
    """Every region the model needs is stored, with the model's global shape, in files that are there (else: a
    one-line UserError naming the tensor, and the file where one is missing), before anything is written."""
    for owner, pieces in groups.items():
        for chunk in pieces:
            stored = chunks.global_shape(chunk.key)
            if stored is None:
                raise UserError(f"{iter_dir} does not match the model in {hf_source}/config.json ({chunk.key} "
                                f"is missing)")  # fmt: skip
            if stored != chunk.global_shape:
                raise UserError(f"{iter_dir} does not match the model in {hf_source}/config.json ({chunk.key} has "
                                f"shape {list(stored)}, the model needs {list(chunk.global_shape)})")  # fmt: skip
            problem = chunks.check_region(chunk.key, chunk.offsets, chunk.sizes)
            if problem is not None:
                raise UserError(f"{iter_dir} cannot be read: {problem}")


def _assemble(chunks: TorchDistChunks, param: Any, pieces: list[Chunk]) -> Any:
    """The parameter's full value from the stored chunks its pieces overlap, whatever layout saved them (one
    stored chunk that is the whole parameter: that tensor, no copy)."""
    import torch

    first = pieces[0]
    if len(pieces) == 1 and first.view[2] == 0 and math.prod(first.sizes) == param.numel():
        if len(chunks.overlapping(first.key, first.offsets, first.sizes)) == 1:
            return chunks.read_region(first.key, first.offsets, first.sizes).reshape(param.shape)
    value = torch.empty(param.shape, dtype=chunks.dtype(first.key))
    for chunk in pieces:
        size, stride, offset = chunk.view
        chunks.read_region(chunk.key, chunk.offsets, chunk.sizes, into=value.as_strided(size, stride, offset))
    return value


class _LazyTask:
    """A skeleton conversion task whose ``param_weight`` is read from the checkpoint when first asked for; every
    other attribute is the skeleton task's."""

    def __init__(self, task: Any, load: Callable[[], Any]) -> None:
        self._task, self._load = task, load

    def __getattr__(self, name: str) -> Any:
        if name != "param_weight":
            return getattr(self._task, name)
        self.param_weight = value = self._load()
        return value


class _LazyTasks:
    """The conversion tasks in checkpoint order, iterable more than once: megatron-bridge 0.4's
    ``stream_weights_megatron_to_hf`` walks them first for the grouped-export counts (reading only ``mapping``),
    then converts. Each pass reads a weight when the conversion asks for it, and the next ``ahead`` with it; a
    weight is held only while the pass holds its task."""

    def __init__(self, tasks: list[Any], read: Callable[[int], Future], *, ahead: int) -> None:
        self._tasks, self._read, self._ahead = tasks, read, ahead

    def __iter__(self) -> Iterator[_LazyTask]:
        reading: dict[int, Future] = {}

        def load(i: int) -> Any:
            for j in range(i, min(i + self._ahead + 1, len(self._tasks))):
                if j not in reading:
                    reading[j] = self._read(j)
            return reading.pop(i).result()

        return (_LazyTask(task, lambda i=i: load(i)) for i, task in enumerate(self._tasks))


def export_streaming_into(
    write: Callable[[str, Any], int],
    *,
    iter_dir: Path,
    hf_source: Path,
    config: Any,
    model_type: str | None,
    dtype: Any,
    hf_names: list[str],
    threads: int = 2,
    advance: Callable[[int], None] | None = None,
) -> tuple[int, int]:
    """Convert the torch_dist checkpoint ``iter_dir`` to HF tensors, each passed to ``write(name, tensor)`` (which
    returns the bytes written). ``hf_names``: the architecture's tensors (what the export plans). ``dtype``: the
    checkpoint's parameter dtype. Returns (tensors, bytes). Raises :class:`NeedsModel` before writing anything
    when a parameter needs the model-building path. Under torchrun rank 0 converts and writes (the others return
    (0, 0) once the checkpoint is checked)."""
    from bridge_ext.convert.model import ConfigSource
    from bridge_ext.convert.parallel import is_rank0

    shim = ConfigSource(config, hf_names, str(hf_source))
    skeleton = build_skeleton(config, model_type=model_type, dtype=dtype, hf=shim)
    groups = _sharded_chunks(skeleton, iter_dir)
    chunks = TorchDistChunks(iter_dir)
    try:
        _check_stored(chunks, groups, iter_dir=iter_dir, hf_source=hf_source)
        if not is_rank0():  # under torchrun every process builds the skeleton (process groups), rank 0 writes
            return 0, 0
        order = list(skeleton.tasks)
        tensors = nbytes = 0
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="torch-dist-reader") as pool:

            def read(owner: tuple[int, str]) -> Future:
                return pool.submit(_assemble, chunks, skeleton.params[owner], groups[owner])

            tasks = _LazyTasks([skeleton.tasks[owner] for owner in order], lambda i: read(order[i]),
                               ahead=max(1, threads))
            stream = skeleton.model_bridge.stream_weights_megatron_to_hf(
                skeleton.model, shim, cpu=True, show_progress=False, conversion_tasks=tasks)
            for name, tensor in stream:
                written = write(name, tensor)
                tensors += 1
                nbytes += written
                if advance is not None:
                    advance(written)
    finally:
        chunks.close()
    return tensors, nbytes
