"""Export: a Megatron checkpoint (import output or a training run) -> a Hugging Face directory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge_ext.checkpoints.integrity import verify
from bridge_ext.convert.megatron_ckpt import (
    cause_line,
    checkpoint_param_dtype,
    hf_source_for_checkpoint,
    load_model_weights,
    tokenizer_dirs,
    find_iteration,
)
from bridge_ext.convert.model import ConfigSource, bridge_for, build_model, prepare_runtime
from bridge_ext.convert.parallel import check_layout, is_rank0, process_group
from bridge_ext.convert.report import ConversionSummary, TensorProgress, say_on_rank0, shard_totals
from bridge_ext.convert.staging import check_target, staged_output
from bridge_ext.convert.stream import DEFAULT_THREADS, NeedsModel, export_streaming_into, missing_stored_file
from bridge_ext.errors import UserError
from bridge_ext.hf.directory import (
    CONVERSION_RECORD,
    FLOAT_ST,
    SAFETENSORS_DTYPES,
    TORCH_TO_ST,
    architecture_of,
    config_from_dir,
    copy_side_files,
    expected_hf_tensors,
    inspect_hf_dir,
)
from bridge_ext.hf.expert_layout import fused_name

__all__ = ['DEFAULT_SHARD_BYTES', 'export_hf']


# Hugging Face's own default (transformers' max_shard_size "5GB").
DEFAULT_SHARD_BYTES = 5 * 10**9


# Kept in float32 by DeepSeek-V3 / Kimi K2 releases whatever the model dtype; also exported that way.
_FP32_TENSOR_SUFFIXES = ("e_score_correction_bias",)


class _ShardWriter:
    """Writes planned safetensors shards in place: each tensor goes to its offset as soon as it arrives.

    The plan (names, shapes, dtypes -> shard and offset) comes from the architecture's tensor list, so the
    headers are written first and no shard is ever buffered in memory.
    """

    def __init__(self, out: Path, plan: dict[str, tuple[tuple[int, ...], str]], *, shard_bytes: int):
        self.out = out
        self.expected = plan
        shards: list[list[str]] = [[]]
        size = 0
        for name, (shape, code) in plan.items():
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[code]
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        count = len(shards)
        self.files: list[str] = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.where: dict[str, tuple[int, int, int]] = {}  # name -> (shard, absolute offset, nbytes)
        self._handles = []
        self.total_bytes = 0
        for i, names in enumerate(shards):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                shape, code = plan[name]
                nbytes = math.prod(shape) * SAFETENSORS_DTYPES[code]
                header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)  # safetensors pads headers to 8 bytes with spaces
            handle = open(out / self.files[i], "wb", buffering=0)
            handle.write(struct.pack("<Q", len(blob)) + blob)
            handle.truncate(8 + len(blob) + offset)
            self._handles.append(handle)
            base = 8 + len(blob)
            for name in names:
                begin, end = header[name]["data_offsets"]
                self.where[name] = (i, base + begin, end - begin)
            self.total_bytes += offset
        self.written: set[str] = set()

    def write(self, name: str, tensor: Any) -> int:
        import torch

        if name not in self.where:
            raise RuntimeError(f"export produced {name}, which the architecture does not have")
        if name in self.written:
            raise RuntimeError(f"export produced {name} twice")
        shape, code = self.expected[name]
        if tuple(tensor.shape) != shape:
            raise RuntimeError(f"export produced {name} with shape {list(tensor.shape)}, expected {list(shape)}")
        shard, offset, nbytes = self.where[name]
        target = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}[code]
        data = tensor.detach().to("cpu", target).contiguous()
        if data.numel():
            view = memoryview(data.reshape(-1).view(torch.uint8).numpy())  # no copy
            fd = self._handles[shard].fileno()
            done = 0
            while done < nbytes:  # pwrite may write less than asked
                done += os.pwrite(fd, view[done:], offset + done)
        self.written.add(name)
        return nbytes

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        missing = [n for n in self.expected if n not in self.written]
        if missing:
            raise RuntimeError(f"export did not produce {missing[0]} ({len(missing)} tensors missing)")
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {name: self.files[self.where[name][0]] for name in self.expected},
        }
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.close()


def _export_config_json(hf_source: Path, dest: Path, *, dtype: str) -> list[str]:
    """Write config.json: the source's bytes unchanged, unless the weights now differ in format.

    A source with an fp8 or int4 ``quantization_config`` was dequantized on import; keeping that key would make
    loaders expect fp8 tensors and scales, so it is dropped (the only change) and a note is returned.
    """
    raw_bytes = (hf_source / "config.json").read_bytes()
    raw = json.loads(raw_bytes)
    if "quantization_config" not in raw:
        (dest / "config.json").write_bytes(raw_bytes)
        return []
    method = (raw.pop("quantization_config") or {}).get("quant_method", "")
    declared = raw.get("torch_dtype")
    if declared not in (None, dtype):
        raw["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return [f"config.json: dropped the source's {method} quantization_config (weights are exported as {dtype})"]


def _export_plan(config: Any, *, dtype: str, source_dtypes: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the export writes: the architecture's tensors, routed experts one by one as released checkpoints hold
    them (:mod:`~bridge_ext.hf.expert_layout`: transformers 4 and 5 load it, and Megatron Bridge's mappings
    name it), each in the dtype the import's source stored it in (a fused source: its fused tensor's)."""
    expected = expected_hf_tensors(config)
    code = TORCH_TO_ST[dtype]
    plan = {}
    for name, shape in expected.items():
        recorded = source_dtypes.get(name) or source_dtypes.get(fused_name(name) or "")
        if recorded in FLOAT_ST:
            plan[name] = (shape, recorded)
        elif name.endswith(_FP32_TENSOR_SUFFIXES):
            plan[name] = (shape, "F32")
        else:
            plan[name] = (shape, code)
    return plan


def _export_through_model(write: Callable[[str, Any], int], *, iter_dir: Path, hf_source: Path, config: Any,
                          raw: dict[str, Any], plan: dict[str, Any], cpu: bool, dtype: Any, tp: int, pp: int,
                          ep: int) -> None:
    """The model-building export: the checkpoint loaded into the Megatron model (``--tp/--pp/--ep``), then Megatron
    Bridge's ``stream_weights_megatron_to_hf``; each HF tensor goes to ``write``."""
    bridge = bridge_for(config, model_type=raw.get("model_type"))
    model = build_model(bridge, cpu=cpu, dtype=dtype, tp=tp, pp=pp, ep=ep)
    try:
        load_model_weights(iter_dir, model)
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch DCP's CheckpointException is a BaseException with a multi-line report
        problem = missing_stored_file(iter_dir)  # DCP's report names neither the file nor the tensor
        if problem is not None:
            raise UserError(f"{iter_dir} cannot be read: {problem}") from None
        raise UserError(
            f"{iter_dir} does not match the model in {hf_source}/config.json ({cause_line(exc)})"
        ) from None
    shim = ConfigSource(config, plan.keys(), str(hf_source))
    for name, tensor in bridge._model_bridge.stream_weights_megatron_to_hf(model, shim, cpu=True, show_progress=False):
        write(name, tensor)
    del model


def export_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    iteration: int | None = None,
    overwrite: bool = False,
    hf_config: str | Path | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    progress: bool = True,
    console: Callable[[str], None] | None = print,
    stream: bool = True,
    threads: int = DEFAULT_THREADS,
    checksums: bool = True,
) -> ConversionSummary:
    """Convert a Megatron checkpoint (``import`` output or a training run) into an HF directory at ``out``.

    ``stream`` (default): tensor by tensor from the torch_dist files without building the model
    (:mod:`bridge_ext.convert.stream`; under torchrun rank 0 converts); with ``stream=False``, a ``tp/pp/ep``
    layout, or where a parameter needs the model (``NeedsModel``), the checkpoint is loaded into the built model.
    Before anything is read, the model's part of the iteration is checked against its integrity record
    (``checksums=False``: sizes only; :mod:`bridge_ext.checkpoints.integrity`).
    """
    start = time.perf_counter()
    ckpt, target = Path(ckpt), Path(out)
    check_target(target, overwrite=overwrite, inputs=[ckpt] if ckpt.exists() else [])
    iter_dir, number = find_iteration(ckpt, iteration)
    say_on_rank0(console, verify(iter_dir, scope="model", checksums=checksums).line(iter_dir))
    hf_source = hf_source_for_checkpoint(ckpt, iter_dir, Path(hf_config) if hf_config else None)
    source = inspect_hf_dir(hf_source, check_tensors=False) if any(hf_source.glob("*.safetensors")) else None
    if source is None:
        config, family, raw = config_from_dir(hf_source)
    else:
        config, family, raw = source.config, source.family, source.raw_config
    check_layout(architecture_of(config, raw), tp=tp, pp=pp, ep=ep)
    record_file = hf_source / CONVERSION_RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    declared = str(raw.get("torch_dtype") or raw.get("dtype") or record.get("dtype") or "bfloat16")
    declared = declared.replace("torch.", "")
    if declared not in TORCH_TO_ST:
        raise UserError(f"{hf_source}/config.json: unsupported torch_dtype {declared!r}")
    say_on_rank0(console, f"exporting {family.display} iteration {number} from {iter_dir} "
                          f"(config from {hf_source})")  # fmt: skip

    cpu = prepare_runtime()

    summary = ConversionSummary(direction="export", out=target)
    stored = checkpoint_param_dtype(iter_dir)
    plan = _export_plan(config, dtype=declared, source_dtypes=record.get("tensors", {}))
    with process_group(cpu), staged_output(target) as staging:
        writer = _ShardWriter(staging, plan, shard_bytes=shard_bytes) if is_rank0() else None
        try:
            with TensorProgress("export", total=len(plan), enabled=progress and is_rank0(),
                                total_bytes=writer.total_bytes if writer is not None else None) as bar:

                def write(name: str, tensor: Any) -> int:
                    if writer is None:
                        return 0
                    nbytes = writer.write(name, tensor)
                    summary.tensors += 1
                    summary.bytes += nbytes
                    bar.advance(nbytes)
                    return nbytes

                streamed = False
                if stream and tp == pp == ep == 1:  # a layout asks for the model-building (distributed) path
                    try:
                        export_streaming_into(write, iter_dir=iter_dir, hf_source=hf_source, config=config,
                                              model_type=raw.get("model_type"), dtype=stored, hf_names=list(plan),
                                              threads=threads)  # fmt: skip
                        streamed = True
                    except NeedsModel as exc:  # raised before any tensor is written
                        summary.notes.append(f"converted through the built model: {exc}")
                if not streamed:
                    _export_through_model(write, iter_dir=iter_dir, hf_source=hf_source, config=config, raw=raw,
                                          plan=plan, cpu=cpu, dtype=stored, tp=tp, pp=pp, ep=ep)  # fmt: skip
            if writer is not None:
                writer.close()
                summary.shards = shard_totals((writer.files[shard], nbytes) for shard, _, nbytes in writer.where.values())
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if is_rank0():
            summary.notes += _export_config_json(hf_source, staging, dtype=declared)
            copied = copy_side_files(hf_source, staging)
            for tokenizer_dir in tokenizer_dirs(iter_dir):
                copied += copy_side_files(tokenizer_dir, staging)
            if not any(name.startswith("tokenizer") or name.endswith(".model") for name in copied):
                summary.notes.append("no tokenizer files known for this checkpoint; add them to the export yourself")
    summary.seconds = time.perf_counter() - start
    return summary
