"""``nemo llm import`` / ``nemo llm export``: Hugging Face <-> Megatron checkpoints, safely and verified.

Built on Megatron Bridge's ``AutoBridge`` (``megatron/bridge/models/conversion/auto_bridge.py``, 0.3.1) and
its per-model mappings; what this module adds:

* Validation before any work: directory, ``config.json``, supported architecture, safetensors headers and
  sizes (truncation), every shard the index lists, every tensor the architecture needs (names and shapes,
  from a meta-device transformers model), dtypes. Each problem is one :class:`UserError` line.
* Safety: output goes to a temporary directory beside the target and is renamed into place only when the
  conversion (and ``--verify``) succeeded; a non-empty target is refused without ``--overwrite``; inputs
  are only read.
* Kimi K2 (``model_type: kimi_k2`` + ``auto_map`` into remote code) without remote code: the config is
  built by :func:`bridge_ext.hf.load_hf_config`; the import keeps the source's ``config.json`` bytes and
  tokenizer/generation files next to the checkpoint (``hf_source/``) so an export reproduces them exactly.
* Strict weight accounting: Megatron Bridge skips a parameter with a warning when no mapping matches
  (``model_bridge.py:1205-1226``); here every Megatron parameter must be loaded and every HF tensor of the
  architecture must be written, or the conversion fails.
* Streaming export: shards are planned from the architecture's tensor list and each tensor is written at
  its offset as it arrives, so an export holds the model plus one tensor.
* ``--verify``: the written checkpoint is loaded into an fp32 Megatron model and compared with the
  transformers model on the same tokens; the largest logit difference is reported and checked.
* Export of training runs: latest complete ``iter_*`` or ``--iteration N``; the HF config is found from the
  import's ``hf_source/``, the run's ``hf_model_id`` or the matching shipped recipe config; optimizer state
  is never read; weights load without Megatron Core's gate/up merge copies.
* Kimi K2 / DeepSeek-V3 fp8 releases (e4m3 + 128x128 ``weight_scale_inv``) are dequantized on import.

The CPU path uses :mod:`bridge_ext.cpu_mode` when no GPU is visible.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_ext import checkpoints
from bridge_ext.errors import UserError
from bridge_ext.hf import apply_config_stated_fields

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "HF_SOURCE_DIR",
    "SUPPORTED_ARCHITECTURES",
    "VERIFY_TOLERANCE",
    "ConversionSummary",
    "HFSource",
    "dequantize_fp8",
    "export_hf",
    "find_iteration",
    "import_hf",
    "inspect_hf_dir",
    "read_safetensors_header",
    "register",
    "verify_logits",
]

# HF architecture -> the family name used in messages and docs. Megatron Bridge 0.3.1 has bridges for each.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "Qwen3",
    "Qwen3MoeForCausalLM": "Qwen3-MoE",
    "DeepseekV3ForCausalLM": "DeepSeek-V3 / Kimi K2",
}

# Largest |logit difference| --verify accepts, in fp32. Two correct fp32 implementations differ only by
# summation order (~1e-6 relative per op): the tiny test models measure 0 to 9e-7; for real models with
# 4k-7k hidden sizes and 30-60 layers we expect 1e-5 to 1e-4 (an estimate, not measured here). A wrong
# mapping (swapped gate/up, rope layout, router scoring, expert bias) moves logits by O(0.1-1), so 1e-3
# leaves margin on both sides.
VERIFY_TOLERANCE = 1e-3

# Hugging Face's own default (transformers' max_shard_size "5GB").
DEFAULT_SHARD_BYTES = 5 * 10**9

# Next to an imported checkpoint: the source's config.json (bytes), tokenizer and generation files.
HF_SOURCE_DIR = "hf_source"
CONVERSION_RECORD = "conversion.json"

# Files copied from an HF source to an export (and kept at import). Never weights, never executed here.
_SIDE_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "*.py",  # remote code named by auto_map (Kimi K2): copied so the export is a complete repository
    "LICENSE*",
)

_SAFETENSORS_DTYPES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
_TORCH_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_FLOAT_ST = {"F64", "F32", "F16", "BF16"}
_FP8_ST = {"F8_E4M3", "F8_E5M2"}

# Kept in float32 by DeepSeek-V3 / Kimi K2 releases whatever the model dtype; also exported that way.
_FP32_TENSOR_SUFFIXES = ("e_score_correction_bias",)


# ---------------------------------------------------------------------------------------------------------
# Summary and progress
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ConversionSummary:
    """What a conversion did: the final line the CLI prints (tensors, bytes, time, throughput)."""

    direction: str
    out: Path
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    max_logit_diff: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Bytes per second over the whole conversion."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        verified = "" if self.max_logit_diff is None else f", verified: max |logit diff| {self.max_logit_diff:.2e}"
        return (
            f"{self.direction}: {self.tensors} tensors, {_human_bytes(self.bytes)} in {self.seconds:.1f} s "
            f"({_human_bytes(self.throughput)}/s){verified} -> {self.out}"
        )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


class _Progress:
    """A rich progress bar over tensors (with bytes), or nothing when disabled / not on rank 0."""

    def __init__(self, description: str, *, total: int, enabled: bool):
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from rich.console import Console

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tensors"),
                TextColumn("{task.fields[size]}"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                transient=False,
                console=Console(file=_REAL_STREAMS[1]) if _REAL_STREAMS else None,
            )
        self._description = description
        self._total = total
        self._bytes = 0

    def __enter__(self) -> _Progress:
        self._start = time.perf_counter()
        if self._bar is not None:
            self._bar.__enter__()
            self._task = self._bar.add_task(self._description, total=self._total, size="", rate="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def advance(self, nbytes: int, *, tensors: int = 1) -> None:
        """``tensors`` more done (HF tensors: a fused Megatron parameter counts its parts), ``nbytes`` more."""
        self._bytes += nbytes
        if self._bar is not None:
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            self._bar.update(self._task, advance=tensors, size=_human_bytes(self._bytes),
                             rate=f"{_human_bytes(self._bytes / elapsed)}/s")  # fmt: skip


# (stdout, stderr) while :func:`_quiet_upstream` captures upstream chatter; our own output goes here.
_REAL_STREAMS: tuple[Any, Any] | None = None


@contextlib.contextmanager
def _quiet_upstream(*, verbose: bool) -> Iterator[Callable[[str], None]]:
    """Keep Megatron / transformers / torch chatter (prints, tqdm bars, warnings) out of the CLI's output.

    Yields the function that prints our own progress lines. Upstream output is buffered and shown (last 60
    lines) only if the conversion fails with something other than a :class:`UserError`.
    """
    global _REAL_STREAMS
    import io
    import logging
    import warnings

    real_out, real_err = sys.stdout, sys.stderr

    def say(message: str) -> None:
        print(message, file=real_out, flush=True)

    if verbose:
        yield say
        return
    # Environment, not imports: importing transformers here would cost seconds before input is validated.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # child processes (checkpoint writers) import torch too
    for name in ("megatron", "torch", "transformers", "nvidia_resiliency_ext", "root"):
        logging.getLogger(None if name == "root" else name).setLevel(logging.ERROR)
    buffer = io.StringIO()
    _REAL_STREAMS = (real_out, real_err)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            warnings.simplefilter("ignore")
            yield say
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        tail = buffer.getvalue().splitlines()[-60:]
        if tail:
            print("--- last upstream output ---\n" + "\n".join(tail), file=real_err)
        raise
    finally:
        _REAL_STREAMS = None


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except ImportError:
        return True


def _say(console: Callable[[str], None] | None, message: str) -> None:
    if console is not None and _is_rank0():
        console(message)


# ---------------------------------------------------------------------------------------------------------
# Safe output: a temporary directory beside the target, moved into place when complete
# ---------------------------------------------------------------------------------------------------------


def _check_target(target: Path, *, overwrite: bool, inputs: Iterable[Path]) -> None:
    """Refuse targets that would clobber data or inputs, before any work is done."""
    if target.exists() and not target.is_dir():
        raise UserError(f"output {target} exists and is not a directory; choose another --out")
    for source in inputs:
        source = source.resolve()
        resolved = target.resolve()
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise UserError(f"output {target} overlaps the input {source}; choose an --out outside it")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise UserError(f"output {target} exists and is not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def _staged_output(target: Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; on success it replaces ``target``, else it is removed.

    Beside the target (same filesystem) so the final step is a rename, not a copy. SIGTERM is turned into
    SystemExit for the duration so an interrupted conversion also cleans up.
    """
    target = target.absolute()
    created: list[Path] = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    previous = None
    if _is_main_thread():  # before the directory exists, so no window leaves it behind
        previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    staging: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = _shared_path(lambda: tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        yield staging
        _barrier()  # every rank has written its part
        if _is_rank0():
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, old / "x")
                os.replace(staging, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, target)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for path in created:  # parents we made for a conversion that produced nothing
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except ImportError:
        return 1


def _barrier() -> None:
    if _world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def _shared_path(make: Callable[[], str]) -> Path:
    """``make()`` on rank 0, the same path on every rank (one staging directory for a torchrun job)."""
    if _world_size() == 1:
        return Path(make())
    import torch.distributed as dist

    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face input validation
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class HFSource:
    """A validated Hugging Face checkpoint directory."""

    path: Path
    raw_config: dict[str, Any]
    config: Any  # transformers PretrainedConfig (never from remote code)
    architecture: str
    tensors: dict[str, TensorInfo]
    files: list[str]
    dtype: str  # the weights' dtype as a torch dtype name ("bfloat16", ...)
    fp8: bool = False  # block-quantized fp8 weights with *_scale_inv tensors (dequantized on import)
    fp8_block: tuple[int, int] = (128, 128)  # quantization_config.weight_block_size

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header against its size (catches truncation and corruption).

    Format: 8-byte little-endian header length, a JSON header, then the data buffer that the header's
    ``data_offsets`` must cover exactly (https://github.com/huggingface/safetensors#format).
    """
    size = file.stat().st_size
    where = f"{file.parent.name}/{file.name}"
    if size < 8:
        raise UserError(f"{where} is truncated ({size} bytes); re-download or re-save it")
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > size - 8 or header_len > 100 * 2**20:
            raise UserError(f"{where} is not a valid safetensors file (header length {header_len}, file {size} bytes)")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{where} is corrupt: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise UserError(f"{where} is corrupt: its safetensors header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    end_max = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{where} is corrupt: bad header entry for tensor {name}") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise UserError(f"{where}: tensor {name} has unknown dtype {dtype}")
        expected = math.prod(shape) * _SAFETENSORS_DTYPES[dtype]
        if end - begin != expected or begin < 0:
            raise UserError(f"{where} is corrupt: tensor {name} spans {end - begin} bytes, its shape needs {expected}")
        if end > data_len:
            raise UserError(
                f"{where} is truncated: tensor {name} ends at byte {end} of a {data_len}-byte data section; "
                "re-download or re-save it"
            )
        end_max = max(end_max, end)
        tensors[name] = TensorInfo(file=file.name, dtype=dtype, shape=shape, nbytes=expected)
    if end_max != data_len:
        raise UserError(f"{where} is corrupt: {data_len - end_max} bytes after the last tensor")
    return tensors


def _expected_hf_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture's transformers model has (name -> shape), built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in state.items()}


def _st_to_torch_name(code: str) -> str:
    return {v: k for k, v in _TORCH_TO_ST.items()}.get(code, code.lower())


def inspect_hf_dir(path: str | Path, *, check_tensors: bool = True) -> HFSource:
    """Validate a Hugging Face checkpoint directory; raise :class:`UserError` naming the first problem."""
    from bridge_ext.hf import MODEL_TYPE_ALIASES, load_hf_config

    path = Path(path)
    if not path.exists():
        raise UserError(f"--hf {path} does not exist")
    if not path.is_dir():
        raise UserError(f"--hf {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} has no config.json; point --hf at a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{config_file} is not a JSON object")
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        from bridge_ext.errors import closest

        name = architectures[0] if architectures else f"model_type {raw.get('model_type')!r}"
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        hint = closest(str(name), SUPPORTED_ARCHITECTURES)
        raise UserError(f"unsupported architecture {name}{hint}; supported: {supported}")
    try:
        config = load_hf_config(path)
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        model_type = raw.get("model_type")
        raise UserError(
            f"{config_file}: transformers cannot build a config for model_type {model_type!r} ({first})"
        ) from None
    if config.model_type not in {"qwen3", "qwen3_moe", "deepseek_v3"}:
        raise UserError(
            f"{config_file}: architecture {architecture} with model_type {raw.get('model_type')!r} is not supported "
            f"(known aliases: {', '.join(MODEL_TYPE_ALIASES) or 'none'})"
        )

    # Shards: the index, if any, names them; otherwise every *.safetensors in the directory.
    index_file = path / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{index_file} is corrupt (no valid weight_map)") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise UserError(f"{path}: shard {missing[0]}{more} listed in model.safetensors.index.json is missing")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            if any(path.glob("*.bin")) or any(path.glob("*.pt")):
                raise UserError(f"{path} has only PyTorch .bin/.pt weights; save it with safe_serialization=True")
            raise UserError(f"{path} has no *.safetensors weights")

    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for key, info in read_safetensors_header(path / name).items():
            if key in tensors:
                raise UserError(f"{path}: tensor {key} appears in both {tensors[key].file} and {info.file}")
            tensors[key] = info
    if weight_map is not None:
        for key, file in weight_map.items():
            if key not in tensors or tensors[key].file != file:
                raise UserError(f"{path}: the index puts {key} in {file}, but that shard does not contain it")

    quant = raw.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8"
    declared = raw.get("torch_dtype") or raw.get("dtype")
    dtype = _check_dtypes(path, tensors, declared=declared, fp8=fp8)

    if check_tensors:
        expected = _expected_hf_tensors(config)
        missing = [k for k in expected if k not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UserError(f"{path}: tensor {missing[0]}{more} is missing for {architecture}; is a shard incomplete?")
        for key, shape in expected.items():
            if tensors[key].shape != shape:
                raise UserError(
                    f"{path}: tensor {key} has shape {list(tensors[key].shape)}, config.json implies {list(shape)}"
                )
    block = tuple(quant.get("weight_block_size") or (128, 128))
    if fp8 and (len(block) != 2 or quant.get("fmt", "e4m3") != "e4m3"):
        raise UserError(f"{config_file}: only e4m3 fp8 with 2-D weight_block_size is supported, got {quant}")
    return HFSource(path=path, raw_config=raw, config=config, architecture=architecture, tensors=tensors,
                    files=files, dtype=dtype, fp8=fp8, fp8_block=block)  # fmt: skip


def _check_dtypes(path: Path, tensors: dict[str, TensorInfo], *, declared: str | None, fp8: bool) -> str:
    """The weights' dtype; a UserError when tensors disagree with each other or with config.json.

    Matrices must all have one dtype, the declared ``torch_dtype`` when config.json has one (or fp8 when it
    declares fp8 quantization). Vectors (norms, biases) may also be float32, as DeepSeek-V3 releases keep
    ``e_score_correction_bias``.
    """
    matrix_dtypes: dict[str, str] = {}
    for key, info in tensors.items():
        if info.dtype not in _FLOAT_ST | _FP8_ST:
            raise UserError(f"{path}: tensor {key} has dtype {info.dtype}; weights must be floating point")
        if fp8 and key.endswith("_scale_inv"):
            continue
        if len(info.shape) >= 2:
            matrix_dtypes.setdefault(info.dtype, key)
    if fp8:
        wanted = {"F8_E4M3"}
        others = {d: k for d, k in matrix_dtypes.items() if d not in wanted | _FLOAT_ST}
        if others:
            code, key = next(iter(others.items()))
            raise UserError(f"dtype mismatch in {path}: tensor {key} is {code}, config.json declares fp8 (e4m3)")
        return declared or "bfloat16"
    if any(code in _FP8_ST for code in matrix_dtypes):
        code = next(c for c in matrix_dtypes if c in _FP8_ST)
        raise UserError(
            f"dtype mismatch in {path}: tensor {matrix_dtypes[code]} is {code} but config.json has no fp8 "
            "quantization_config"
        )
    if declared is not None:
        want = _TORCH_TO_ST.get(str(declared).replace("torch.", ""))
        if want is None:
            raise UserError(f"{path}/config.json: unsupported torch_dtype {declared!r}")
        for code, key in matrix_dtypes.items():
            if code != want:
                raise UserError(
                    f"dtype mismatch in {path}: tensor {key} is {code}, config.json declares torch_dtype {declared}"
                )
        for key, info in tensors.items():
            if len(info.shape) < 2 and info.dtype not in {want, "F32"}:
                raise UserError(
                    f"dtype mismatch in {path}: tensor {key} is {info.dtype}, config.json declares torch_dtype "
                    f"{declared}"
                )
        return str(declared).replace("torch.", "")
    if len(matrix_dtypes) > 1:
        (a, ka), (b, kb) = list(matrix_dtypes.items())[:2]
        raise UserError(f"dtype mismatch in {path}: tensor {ka} is {a} but {kb} is {b}")
    return _st_to_torch_name(next(iter(matrix_dtypes), "F32"))


# ---------------------------------------------------------------------------------------------------------
# Megatron checkpoint discovery
# ---------------------------------------------------------------------------------------------------------

# Which iteration to export: the one a rerun of the training command resumes from (bridge_ext.checkpoints,
# shared with training), or a complete one chosen with --iteration.
find_iteration = checkpoints.find_iteration


def _read_run_config(iter_dir: Path) -> dict[str, Any]:
    file = iter_dir / "run_config.yaml"
    if not file.is_file():
        return {}
    try:
        import yaml

        return yaml.safe_load(file.read_text()) or {}
    except Exception:  # a run config we cannot parse only loses us a hint
        return {}


def _hf_source_for_checkpoint(ckpt: Path, iter_dir: Path, explicit: Path | None) -> Path:
    """Where the HF config (and tokenizer files) of a Megatron checkpoint are.

    In order: ``--hf-config``; the ``hf_source/`` kept by ``import`` (checkpoint root, or the root above an
    iteration directory); the ``model.hf_model_id`` a Megatron Bridge run recorded in ``run_config.yaml``
    when it is a local directory; the shipped recipe config whose sizes match the run's model.
    """
    if explicit is not None:
        if not (explicit / "config.json").is_file():
            raise UserError(f"--hf-config {explicit} has no config.json")
        return explicit
    for root in (ckpt, iter_dir, iter_dir.parent):
        if (root / HF_SOURCE_DIR / "config.json").is_file():
            return root / HF_SOURCE_DIR
    model = _read_run_config(iter_dir).get("model") or {}
    model = model if isinstance(model, dict) else {}
    hf_id = model.get("hf_model_id")
    if hf_id and (Path(hf_id) / "config.json").is_file():
        return Path(hf_id)
    shipped = _matching_shipped_config(model)
    if shipped is not None:
        return shipped
    hint = f" (its run config names {hf_id!r}, which is not a local directory)" if hf_id else ""
    raise UserError(
        f"{ckpt} does not say which Hugging Face config it was built from{hint}; pass --hf-config DIR "
        "(a directory with the model's config.json)"
    )


# HF config key -> Megatron provider field, for recognizing which shipped config a run trained.
_PROVIDER_FIELDS: dict[str, str] = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "ffn_hidden_size",
    "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "num_experts": "num_moe_experts",
    "n_routed_experts": "num_moe_experts",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "num_experts_per_tok": "moe_router_topk",
    "kv_lora_rank": "kv_lora_rank",
    "q_lora_rank": "q_lora_rank",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
}


def _shipped_config_dirs() -> list[Path]:
    try:
        from recipes.models import HF_CONFIGS
    except ImportError:  # recipes not installed: nothing shipped to match
        return []
    return sorted(p.parent for p in Path(HF_CONFIGS).glob("*/config.json"))


def _matching_shipped_config(model: dict[str, Any]) -> Path | None:
    """The one shipped ``recipes/hf_configs/<name>`` whose sizes equal the run's model section, if any.

    Recipes build their models from these configs (``bridge_ext/build.py``) without recording the directory
    (``model.hf_model_id`` is null), so a run is recognized by its architecture numbers. A run whose model
    was overridden matches none and must name its config with ``--hf-config``.
    """
    if not model.get("hidden_size") or not model.get("num_layers"):
        return None
    matches = []
    for directory in _shipped_config_dirs():
        try:
            raw = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError):
            continue
        expected = {field: raw[key] for key, field in _PROVIDER_FIELDS.items() if key in raw}
        if not any(key in raw for key in ("num_experts", "n_routed_experts")):
            expected["num_moe_experts"] = None
        expected["multi_latent_attention"] = "kv_lora_rank" in raw
        if all(model.get(field, False if field == "multi_latent_attention" else None) == value
               for field, value in expected.items()):  # fmt: skip
            matches.append(directory)
    return matches[0] if len(matches) == 1 else None


# ---------------------------------------------------------------------------------------------------------
# Megatron side (lazy imports: torch / Megatron load only when a conversion runs)
# ---------------------------------------------------------------------------------------------------------


def _use_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def _prepare_runtime() -> bool:
    """Import guards, CPU mode when no GPU is visible, and DeepSeek SequentialMLP mappings. True on CPU."""
    from bridge_ext.te_guard import install_te_import_guard

    install_te_import_guard()
    cpu = _use_cpu()
    if cpu:
        from bridge_ext import cpu_mode

        if not hasattr(cpu_mode, "enable_cpu_mode"):
            raise RuntimeError("bridge_ext.cpu_mode.enable_cpu_mode is missing; CPU conversion needs it")
        cpu_mode.enable_cpu_mode()
    _add_deepseek_sequential_expert_mappings()
    return cpu


_SEQUENTIAL_MLP_PATCHED = False


def _add_deepseek_sequential_expert_mappings() -> None:
    """Give Megatron Bridge's DeepSeek-V3 bridge the SequentialMLP (``local_experts``) parameter names.

    ``megatron/bridge/models/deepseek/common.py:103,132-136`` (megatron-bridge 0.3.1) map only the grouped-GEMM
    expert names (``mlp.experts.linear_fc1.weight<N>``). Without Transformer Engine or on CPU, experts are a
    SequentialMLP (``mlp.experts.local_experts.<N>.linear_fc1.weight``); ``build_conversion_tasks``
    (``model_bridge.py:1205``) then skips them with a warning, so they would be neither loaded nor exported.
    Qwen3-MoE's bridge already has both sets (``qwen/qwen3_moe_bridge.py:110-118``); this adds the same two.
    """
    global _SEQUENTIAL_MLP_PATCHED
    if _SEQUENTIAL_MLP_PATCHED:
        return
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    original = DeepSeekV3Bridge.mapping_registry

    def mapping_registry(self) -> MegatronMappingRegistry:
        registry = original(self)
        names = {m.megatron_param for m in registry.mappings}
        extra = []
        if "decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight" not in names:
            extra.append(
                GatedMLPMapping(
                    megatron_param="decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                    gate="model.layers.*.mlp.experts.*.gate_proj.weight",
                    up="model.layers.*.mlp.experts.*.up_proj.weight",
                )
            )
        if "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight" not in names:
            extra.append(
                AutoMapping(
                    megatron_param="decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
                    hf_param="model.layers.*.mlp.experts.*.down_proj.weight",
                )
            )
        return MegatronMappingRegistry(*registry.mappings, *extra) if extra else registry

    DeepSeekV3Bridge.mapping_registry = mapping_registry
    _fix_sequential_expert_export()
    _SEQUENTIAL_MLP_PATCHED = True


def _fix_sequential_expert_export() -> None:
    """Export SequentialMLP experts (``local_experts.<N>``) with expert-parallel size 1.

    ``megatron/bridge/models/conversion/param_mapping.py:674-678`` (megatron-bridge 0.3.1) reads the expert
    number from the text after ``.weight`` (grouped-GEMM names ``linear_fc1.weight<N>``); for
    ``local_experts.<N>.linear_fc1.weight`` that text is empty and ``int('')`` raises. With one EP rank
    there is nothing to gather: the weight is the HF expert's. (With EP > 1 upstream does not globalize
    ``local_experts`` numbers either, ``model_bridge.py:148``; we refuse that combination.)
    """
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    original = MegatronParamMapping.gather_from_ep_ranks
    if getattr(original, "_bridge_ext", False):
        return

    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):
        if ".local_experts." not in self.megatron_param:
            return original(self, megatron_weights, megatron_module, hf_param_name)
        if self.ep_size != 1:
            raise UserError("SequentialMLP experts (no grouped GEMM) cannot be exported with --ep > 1; use --ep 1")
        return {str(hf_param_name): megatron_weights}

    gather_from_ep_ranks._bridge_ext = True  # type: ignore[attr-defined]
    MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks


def _configure_provider(provider: Any, *, cpu: bool, dtype: Any) -> None:
    """Settings for building the model to convert: official Megatron options, no patches.

    On CPU, :func:`bridge_ext.cpu_mode.configure_for_cpu` (local layer spec, fusions off, SequentialMLP
    experts, allgather dispatcher); then the checkpoint's own dtype instead of CPU mode's fp32, so an
    import holds the weights once at their stored size. No initialization: weights are loaded right after.
    """
    import torch

    if cpu:
        from bridge_ext.cpu_mode import configure_for_cpu

        configure_for_cpu(provider)
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    if hasattr(provider, "pipeline_dtype"):
        provider.pipeline_dtype = dtype
    if hasattr(provider, "autocast_dtype"):
        provider.autocast_dtype = dtype
    provider.perform_initialization = False
    provider.use_cpu_initialization = cpu


@contextlib.contextmanager
def _distributed(cpu: bool) -> Iterator[None]:
    """A process group and Megatron parallel state: world size 1 unless launched by torchrun."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    if owned:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            if cpu:
                raise UserError("distributed conversion (torchrun with WORLD_SIZE > 1) needs GPUs")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl")
        elif cpu:
            from bridge_ext.cpu_mode import init_single_process_distributed

            init_single_process_distributed()
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group("nccl", rank=0, world_size=1)
    initialized_here = not parallel_state.model_parallel_is_initialized()
    try:
        yield
    finally:
        if initialized_here and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if owned and dist.is_initialized():
            dist.destroy_process_group()
        if owned:  # a process group we made leaves no rendezvous variables behind (e.g. for subprocesses)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_parallel(*, tp: int, pp: int, ep: int, cpu: bool) -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    if not cpu:
        model_parallel_cuda_manual_seed(0)
    else:
        with contextlib.suppress(Exception):  # CPU mode maps the CUDA RNG tracker to the CPU generator
            model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)


class _ConfigSource:
    """What Megatron Bridge's conversion reads from an HF model, without weights.

    ``build_conversion_tasks`` needs ``state.source.get_all_keys()`` (``model_bridge.py:1185``) to decide which
    tensors exist; for an export those are the architecture's tensors, listed from a meta-device model.
    """

    def __init__(self, config: Any, keys: Iterable[str], path: str | None = None):
        import torch
        from megatron.bridge.models.hf_pretrained.state import StateDict

        self.config = config
        self.model_name_or_path = path
        self.trust_remote_code = False
        self.state = StateDict({k: torch.empty(0, device="meta") for k in keys})


def _bridge_for(config: Any, pretrained: Any | None = None) -> Any:
    """An ``AutoBridge`` for a transformers config (built by :func:`bridge_ext.hf.load_hf_config`)."""
    from megatron.bridge import AutoBridge

    try:
        AutoBridge._validate_config(config)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"Megatron Bridge cannot convert {config.architectures}: {first}") from None
    return AutoBridge(pretrained if pretrained is not None else config)


def _build_model(bridge: Any, *, cpu: bool, dtype: Any, tp: int = 1, pp: int = 1, ep: int = 1) -> list[Any]:
    provider = bridge.to_megatron_provider(load_weights=False)
    hf = bridge.hf_pretrained  # a PreTrainedCausalLM, or a bare transformers config
    apply_config_stated_fields(provider, getattr(hf, "config", hf))
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.expert_model_parallel_size = ep
    provider.sequence_parallel = False
    _configure_provider(provider, cpu=cpu, dtype=dtype)
    provider.finalize()
    _init_parallel(tp=tp, pp=pp, ep=ep, cpu=cpu)
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=cpu)


def _model_param_names(model: list[Any]) -> list[tuple[int, str]]:
    from megatron.bridge.models.conversion.model_bridge import persistent_buffers

    names = []
    for vp, module in enumerate(model):
        for name, _ in list(module.named_parameters()) + list(persistent_buffers(module)):
            while name.startswith("module."):  # Float16Module / DDP wrappers, as model_bridge._unwrap_name
                name = name[len("module.") :]
            if "_extra_state" not in name:
                names.append((vp, name))
    return names


# ---------------------------------------------------------------------------------------------------------
# Import: HF -> Megatron
# ---------------------------------------------------------------------------------------------------------


def dequantize_fp8(weight: Any, scale_inv: Any, block: tuple[int, int]) -> Any:
    """Block-quantized fp8 -> bf16: ``W = W_fp8 * scale_inv`` per ``block`` (rows x cols) tile.

    The layout of DeepSeek-V3 / Kimi K2 releases: ``W_scale_inv`` has shape
    ``ceil(rows / block[0]) x ceil(cols / block[1])`` (DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``).
    """
    import torch

    rows, cols = weight.shape
    scale = scale_inv.to(torch.float32)
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.to(torch.float32) * full).to(torch.bfloat16)


def _fp8_dequantizing(load: Callable[..., Any], source: HFSource) -> Callable[..., Any]:
    """Wrap ``maybe_modify_loaded_hf_weight`` so block-quantized fp8 weights arrive dequantized.

    Megatron Bridge 0.3.1 has no fp8 dequantization on import (``model_bridge.py:654-675`` is the hook).
    """
    import torch

    def dequant(name: str, weight: Any, state: Any) -> Any:
        scale_name = f"{name}_scale_inv"
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scale_name not in source.tensors:
            return weight
        return dequantize_fp8(weight, state[scale_name], source.fp8_block)

    def wrapped(hf_param: Any, state: Any) -> Any:
        loaded = load(hf_param, state)
        if isinstance(hf_param, str):
            return dequant(hf_param, loaded, state)
        return {k: dequant(hf_param[k], v, state) for k, v in loaded.items()}

    return wrapped


def _load_hf_into_megatron(
    bridge: Any, pretrained: Any, model: list[Any], source: HFSource, *, progress: bool
) -> tuple[int, int]:
    """Load every Megatron parameter from the HF tensors (``model_bridge.py:697-803``, with accounting).

    Returns the HF tensors read (fp8 scales included) and their bytes.
    """
    import torch

    model_bridge = bridge._model_bridge
    tasks = [t for t in model_bridge.build_conversion_tasks(pretrained, model) if t is not None]
    local = [t for t in tasks if t.megatron_module is not None]
    loaded = {(t.vp_stage, t.param_name) for t in local}
    missing = [vp_name for vp_name in _model_param_names(model) if vp_name not in loaded]
    if missing:
        raise RuntimeError(
            f"no conversion for Megatron parameter {missing[0][1]} ({len(missing)} in all); "
            "the Megatron Bridge mapping for this architecture is incomplete"
        )
    state = pretrained.state
    load = model_bridge.maybe_modify_loaded_hf_weight
    if source.fp8:
        load = _fp8_dequantizing(load, source)
    seen: set[str] = set()
    nbytes = 0
    total = len({n for t in local for n in _hf_names(t.mapping.hf_param)})
    with _Progress("import", total=total, enabled=progress and _is_rank0()) as bar:
        for task in local:
            hf_weights = load(task.mapping.hf_param, state)
            converted = task.mapping.hf_to_megatron(hf_weights, task.megatron_module)
            names = _hf_names(task.mapping.hf_param)
            fresh = [n for n in names if n not in seen]
            names += [f"{n}_scale_inv" for n in names if f"{n}_scale_inv" in source.tensors]  # fp8 block scales
            task_bytes = sum(source.tensors[n].nbytes for n in names if n in source.tensors and n not in seen)
            seen.update(names)
            nbytes += task_bytes
            if converted is not None:
                if converted.shape != task.param_weight.shape:
                    raise UserError(
                        f"{source.path}: {names[0]} converts to shape {list(converted.shape)}, the model built from "
                        f"config.json needs {list(task.param_weight.shape)} for {task.param_name}"
                    )
                with torch.no_grad():
                    task.param_weight.data.copy_(converted)
            del hf_weights, converted
            bar.advance(task_bytes, tensors=len(fresh))
    model_bridge._broadcast_shared_embeddings(model)
    return seen & set(source.tensors), nbytes


def _hf_names(hf_param: str | dict[str, str]) -> list[str]:
    return [hf_param] if isinstance(hf_param, str) else list(hf_param.values())


def _copy_side_files(source: Path, dest: Path) -> list[str]:
    """Copy tokenizer / generation / remote-code files (never weights, never config.json)."""
    copied = []
    for pattern in _SIDE_FILE_PATTERNS:
        for file in sorted(source.glob(pattern)):
            if file.is_file() and file.name != "config.json" and not (dest / file.name).exists():
                shutil.copy2(file, dest / file.name)
                copied.append(file.name)
    return copied


def _hf_tokenizer_loadable(path: Path) -> bool:
    """True when transformers can load the tokenizer at ``path`` without remote code."""
    config_file = path / "tokenizer_config.json"
    if not any((path / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        return False
    if config_file.is_file():
        with contextlib.suppress(Exception):
            if "auto_map" in json.loads(config_file.read_text()):
                return False
    return True


def import_hf(
    hf: str | Path,
    out: str | Path,
    *,
    verify: bool = False,
    overwrite: bool = False,
    tolerance: float = VERIFY_TOLERANCE,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    progress: bool = True,
    console: Callable[[str], None] | None = print,
) -> ConversionSummary:
    """Convert the HF checkpoint ``hf`` into a Megatron (torch_dist) checkpoint at ``out``.

    ``out`` receives ``iter_0000000/`` + ``latest_checkpointed_iteration.txt`` (what recipes load with
    ``checkpoint.pretrained_checkpoint=out``) and ``hf_source/`` (config.json bytes, tokenizer files).
    """
    start = time.perf_counter()
    hf, target = Path(hf), Path(out)
    _check_target(target, overwrite=overwrite, inputs=[hf] if hf.exists() else [])
    if verify and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--verify runs in one process; drop it under torchrun and verify on one GPU (see docs)")
    source = inspect_hf_dir(hf)
    summary = ConversionSummary(direction="import", out=target)
    _say(console, f"importing {SUPPORTED_ARCHITECTURES[source.architecture]} from {hf} "
                  f"({len(source.tensors)} tensors, {_human_bytes(source.total_bytes)}, {source.dtype})")  # fmt: skip

    cpu = _prepare_runtime()
    import torch
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
    from megatron.bridge.training.model_load_save import save_megatron_model

    dtype = getattr(torch, source.dtype)
    with _distributed(cpu), _staged_output(target) as staging:
        pretrained = PreTrainedCausalLM(model_name_or_path=str(hf.absolute()), torch_dtype=dtype)
        pretrained.config = source.config  # built without remote code; AutoConfig would refuse kimi_k2
        bridge = _bridge_for(source.config, pretrained)
        model = _build_model(bridge, cpu=cpu, dtype=dtype, tp=tp, pp=pp, ep=ep)
        used, summary.bytes = _load_hf_into_megatron(bridge, pretrained, model, source, progress=progress)
        summary.tensors = len(used)
        unused = sorted(set(source.tensors) - used)
        if unused:
            summary.notes.append(f"{len(unused)} HF tensors not used by {source.architecture} (e.g. {unused[0]})")
        tokenizer = hf.absolute() if _hf_tokenizer_loadable(hf) else None
        _say(console, "writing torch_dist checkpoint")
        save_megatron_model(model, str(staging), hf_tokenizer_path=tokenizer, low_memory_save=True)
        del model
        if _is_rank0():
            side = staging / HF_SOURCE_DIR
            side.mkdir()
            shutil.copy2(hf / "config.json", side / "config.json")
            _copy_side_files(hf, side)
            record = {
                "direction": "import",
                "source": str(hf.absolute()),
                "architecture": source.architecture,
                "dtype": source.dtype,
                "fp8_source": source.fp8,
                "tensors": {k: v.dtype for k, v in sorted(source.tensors.items())},
            }
            (side / CONVERSION_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if verify:
            iter_dir, _ = find_iteration(staging)
            _say(console, "verifying: transformers vs Megatron logits in fp32")
            summary.max_logit_diff = verify_logits(hf, iter_dir, source=source, cpu=cpu)
            if not summary.max_logit_diff <= tolerance:
                raise UserError(
                    f"verification failed: max |logit difference| {summary.max_logit_diff:.3e} exceeds the tolerance "
                    f"{tolerance:.0e}; nothing was written to {target}"
                )
    summary.seconds = time.perf_counter() - start
    return summary


# ---------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------


def _verify_tokens(vocab_size: int, *, batch: int = 2, seq: int = 24, seed: int = 1234) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def verify_logits(
    hf: str | Path, iter_dir: str | Path, *, source: HFSource | None = None, cpu: bool | None = None
) -> float:
    """Max |logit difference| between transformers (``hf``) and the Megatron checkpoint ``iter_dir``, in fp32.

    The Megatron model is built fresh and loaded from the written checkpoint, so this checks what was saved,
    not what is in memory. Needs both models in fp32 at once: ~4x the bytes of a bf16 checkpoint.
    """
    import torch
    source = source or inspect_hf_dir(hf)
    cpu = _prepare_runtime() if cpu is None else cpu
    device = "cpu" if cpu else f"cuda:{torch.cuda.current_device()}"
    tokens = _verify_tokens(source.config.vocab_size)

    with _distributed(cpu):
        bridge = _bridge_for(source.config)
        model = _build_model(bridge, cpu=cpu, dtype=torch.float32)
        _load_model_weights(Path(iter_dir), model)
        megatron_model = model[0]
        megatron_model.eval()
        ids = tokens.to(device)
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            logits_m = megatron_model(input_ids=ids, position_ids=positions, attention_mask=None)
        logits_m = logits_m[..., : source.config.vocab_size].float().cpu()
        del model, megatron_model

    hf_model = _hf_reference_model(source).to(device)
    hf_model.eval()
    with torch.no_grad():
        logits_h = hf_model(input_ids=ids).logits.float().cpu()
    del hf_model
    return float((logits_m - logits_h).abs().max())


def _hf_reference_model(source: HFSource) -> Any:
    """The source as a transformers model in fp32 (eager attention); fp8 sources dequantized like the import."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    if not source.fp8:
        return AutoModelForCausalLM.from_pretrained(
            str(source.path), config=source.config, torch_dtype=torch.float32, attn_implementation="eager"
        )
    # transformers would quantize-on-load (GPU only); build in fp32 and load dequantized tensors instead.
    source.config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(source.config, torch_dtype=torch.float32)
    wanted = model.state_dict()
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        if name in source.tensors:
            by_file.setdefault(source.tensors[name].file, []).append(name)
    handles = {f: safe_open(str(source.path / f), "pt") for f in {i.file for i in source.tensors.values()}}
    with torch.no_grad():
        for file, names in by_file.items():
            for name in names:
                tensor = handles[file].get_tensor(name)
                scale = source.tensors.get(f"{name}_scale_inv")
                if tensor.dtype == torch.float8_e4m3fn and scale is not None:
                    scale_inv = handles[scale.file].get_tensor(f"{name}_scale_inv")
                    tensor = dequantize_fp8(tensor, scale_inv, source.fp8_block)
                wanted[name].copy_(tensor.to(torch.float32))
    return model


# ---------------------------------------------------------------------------------------------------------
# Export: Megatron -> HF
# ---------------------------------------------------------------------------------------------------------


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
            nbytes = math.prod(shape) * _SAFETENSORS_DTYPES[code]
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
                nbytes = math.prod(shape) * _SAFETENSORS_DTYPES[code]
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

    A source with an fp8 ``quantization_config`` was dequantized on import; keeping that key would make
    loaders expect fp8 tensors and scales, so it is dropped (the only change) and a note is returned.
    """
    raw_bytes = (hf_source / "config.json").read_bytes()
    raw = json.loads(raw_bytes)
    if "quantization_config" not in raw:
        (dest / "config.json").write_bytes(raw_bytes)
        return []
    raw.pop("quantization_config")
    declared = raw.get("torch_dtype")
    if declared not in (None, dtype):
        raw["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return [f"config.json: dropped the source's fp8 quantization_config (weights are exported as {dtype})"]


def _export_plan(config: Any, *, dtype: str, source_dtypes: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    expected = _expected_hf_tensors(config)
    code = _TORCH_TO_ST[dtype]
    plan = {}
    for name, shape in expected.items():
        recorded = source_dtypes.get(name)
        if recorded in _FLOAT_ST:
            plan[name] = (shape, recorded)
        elif name.endswith(_FP32_TENSOR_SUFFIXES):
            plan[name] = (shape, "F32")
        else:
            plan[name] = (shape, code)
    return plan


def _checkpoint_param_dtype(iter_dir: Path) -> Any:
    """The dtype the checkpoint stores model weights in (from the torch DCP metadata), or None."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(iter_dir)).read_metadata()
    except Exception as exc:
        raise UserError(f"{iter_dir} is not a readable torch_dist checkpoint ({type(exc).__name__}: {exc})") from None
    counts: dict[Any, int] = {}
    for key, meta in metadata.state_dict_metadata.items():
        props = getattr(meta, "properties", None)
        if props is None or not hasattr(meta, "size") or "optim" in key:
            continue
        if "embedding" in key or "linear" in key:
            counts[props.dtype] = counts.get(props.dtype, 0) + 1
    if not counts:
        raise UserError(f"{iter_dir} holds no model weights (is it a Megatron checkpoint of a GPT model?)")
    dtype = max(counts, key=counts.get)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


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
) -> ConversionSummary:
    """Convert a Megatron checkpoint (``import`` output or a training run) into an HF directory at ``out``."""
    start = time.perf_counter()
    ckpt, target = Path(ckpt), Path(out)
    _check_target(target, overwrite=overwrite, inputs=[ckpt] if ckpt.exists() else [])
    iter_dir, number = find_iteration(ckpt, iteration)
    hf_source = _hf_source_for_checkpoint(ckpt, iter_dir, Path(hf_config) if hf_config else None)
    source = inspect_hf_dir(hf_source, check_tensors=False) if any(hf_source.glob("*.safetensors")) else None
    if source is None:
        config, architecture, raw = _config_from_dir(hf_source)
    else:
        config, architecture, raw = source.config, source.architecture, source.raw_config
    record_file = hf_source / CONVERSION_RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    declared = str(raw.get("torch_dtype") or raw.get("dtype") or record.get("dtype") or "bfloat16")
    declared = declared.replace("torch.", "")
    if declared not in _TORCH_TO_ST:
        raise UserError(f"{hf_source}/config.json: unsupported torch_dtype {declared!r}")
    _say(console, f"exporting {SUPPORTED_ARCHITECTURES[architecture]} iteration {number} from {iter_dir} "
                  f"(config from {hf_source})")  # fmt: skip

    cpu = _prepare_runtime()

    summary = ConversionSummary(direction="export", out=target)
    stored = _checkpoint_param_dtype(iter_dir)
    plan = _export_plan(config, dtype=declared, source_dtypes=record.get("tensors", {}))
    with _distributed(cpu), _staged_output(target) as staging:
        bridge = _bridge_for(config)
        model = _build_model(bridge, cpu=cpu, dtype=stored, tp=tp, pp=pp, ep=ep)
        try:
            _load_model_weights(iter_dir, model)
        except (UserError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch DCP's CheckpointException is a BaseException with a multi-line report
            raise UserError(
                f"{iter_dir} does not match the model in {hf_source}/config.json ({_cause_line(exc)})"
            ) from None
        shim = _ConfigSource(config, plan.keys(), str(hf_source))
        writer = _ShardWriter(staging, plan, shard_bytes=shard_bytes) if _is_rank0() else None
        try:
            with _Progress("export", total=len(plan), enabled=progress and _is_rank0()) as bar:
                for name, tensor in bridge._model_bridge.stream_weights_megatron_to_hf(
                    model, shim, cpu=True, show_progress=False
                ):
                    if writer is not None:
                        nbytes = writer.write(name, tensor)
                        summary.tensors += 1
                        summary.bytes += nbytes
                        bar.advance(nbytes)
            if writer is not None:
                writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        del model
        if _is_rank0():
            summary.notes += _export_config_json(hf_source, staging, dtype=declared)
            copied = _copy_side_files(hf_source, staging)
            for tokenizer_dir in _tokenizer_dirs(iter_dir):
                copied += _copy_side_files(tokenizer_dir, staging)
            if not any(name.startswith("tokenizer") or name.endswith(".model") for name in copied):
                summary.notes.append("no tokenizer files known for this checkpoint; add them to the export yourself")
    summary.seconds = time.perf_counter() - start
    return summary


def _load_model_weights(iter_dir: Path, model: list[Any]) -> None:
    """Load a torch_dist checkpoint's model weights (optimizer state is never read) without a second copy.

    Megatron Bridge's ``_load_model_weights_from_checkpoint`` (``training/checkpointing.py:1232-1304``) is
    followed, with one change: the gated fc1 weights are saved as two halves through a factory whose merge
    (``megatron/core/transformer/mlp.py:335-338``, ``torch.cat``) builds a new tensor for every layer and
    expert, all alive next to the model until the final copy: +0.4x of the checkpoint for a dense Qwen3, up
    to +0.65x for MoE models. torch DCP reads the halves in place into views of the parameter, so when both
    halves are such views the merge returns the parameter itself; otherwise the original merge runs.
    """
    from megatron.bridge.training.checkpointing import _generate_model_state_dict
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.utils import unwrap_model

    directory = str(iter_dir)
    common = dist_checkpointing.load_common_state_dict(directory)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    modules = unwrap_model(model)
    sharded = _generate_model_state_dict(modules, dict(metadata=metadata))
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensorFactory) and getattr(value.merge_fn, "__name__", "") == "sh_ten_merge_fn":
            value.merge_fn = _in_place_merge(value.data, value.merge_fn)
    loaded = dist_checkpointing.load(sharded, directory, get_default_load_sharded_strategy(directory))
    for key, module in zip(["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))], modules):
        state = {k: v for k, v in loaded.get(key, {}).items() if "_extra_state" not in k}
        expected = {n for n in module.state_dict() if "_extra_state" not in n}
        missing = sorted(expected - set(state))
        if missing:
            raise UserError(f"{iter_dir} lacks weights for {missing[0]} ({len(missing)} in all)")
        module.load_state_dict(state, strict=False)


def _in_place_merge(param: Any, merge: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``merge``, except when the loaded parts are consecutive views covering ``param``: then ``param``."""

    def end(t: Any) -> int:
        return t.data_ptr() + t.numel() * t.element_size()

    def merged(parts: Any) -> Any:
        parts = list(parts)
        storage = param.untyped_storage().data_ptr()
        contiguous = all(p.untyped_storage().data_ptr() == storage for p in parts) and all(
            end(a) == b.data_ptr() for a, b in zip(parts, parts[1:])
        )
        if contiguous and parts[0].data_ptr() == param.data_ptr() and end(parts[-1]) == end(param):
            return param
        return merge(parts)

    return merged


def _tokenizer_dirs(iter_dir: Path) -> list[Path]:
    """Where a run keeps HF tokenizer files: Megatron Bridge's saved assets, then the run's tokenizer_model."""
    found = [iter_dir / "tokenizer"] if (iter_dir / "tokenizer").is_dir() else []
    tokenizer = _read_run_config(iter_dir).get("tokenizer") or {}
    model = tokenizer.get("tokenizer_model") if isinstance(tokenizer, dict) else None
    if tokenizer.get("tokenizer_type") == "HuggingFaceTokenizer" and model and Path(str(model)).is_dir():
        found.append(Path(str(model)))
    return found


def _cause_line(exc: BaseException) -> str:
    """The informative line of a (possibly multi-line, multi-rank) checkpoint loading error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for needle in ("mismatch", "Missing key", "missing", "Unexpected key", "not found"):
        for line in reversed(lines):
            if needle in line:
                return line[:300]
    return (lines[0] if lines else type(exc).__name__)[:300]


def _config_from_dir(path: Path) -> tuple[Any, str, dict[str, Any]]:
    """Config, architecture and raw dict of a config-only directory (no weights to validate)."""
    from bridge_ext.hf import load_hf_config

    try:
        raw = json.loads((path / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}/config.json is not valid JSON ({exc.msg})") from None
    architecture = next((a for a in raw.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UserError(f"unsupported architecture {raw.get('architectures')}; supported: {supported}")
    return load_hf_config(path), architecture, raw


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _bytes_arg(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError("a size such as 5GB, 500MB or 1000000")
    scale = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed conversion (GPU nodes, launched with torchrun)")
    group.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (default 1)")
    group.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel size (default 1)")
    group.add_argument("--ep", type=_positive, default=1, help="expert-parallel size (default 1)")


def register(subparsers: Any) -> None:
    """Add ``import`` and ``export`` to an argparse subparsers object (``nemo llm ...``)."""
    imp = subparsers.add_parser(
        "import",
        help="Hugging Face directory -> Megatron checkpoint",
        description="Convert a Hugging Face model directory (Qwen3, Qwen3-MoE, DeepSeek-V3 / Kimi K2) into a "
        "Megatron torch_dist checkpoint that recipes load with checkpoint.pretrained_checkpoint=OUT.",
    )
    imp.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory (config.json + safetensors)")
    imp.add_argument("--out", required=True, type=Path, help="directory for the Megatron checkpoint")
    imp.add_argument("--verify", action="store_true", help="compare transformers and Megatron logits in fp32")
    imp.add_argument("--tolerance", type=float, default=VERIFY_TOLERANCE,
                     help=f"largest |logit difference| --verify accepts (default {VERIFY_TOLERANCE:g})")  # fmt: skip
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    imp.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    _parallel_args(imp)
    imp.set_defaults(func=run_import)

    exp = subparsers.add_parser(
        "export",
        help="Megatron checkpoint -> Hugging Face directory",
        description="Convert a Megatron checkpoint (from import or a training run) into a Hugging Face directory: "
        "config.json, safetensors shards with an index, tokenizer and generation files when known.",
    )
    exp.add_argument("--ckpt", required=True, type=Path,
                     help="checkpoint root (iter_* directories) or one iter_* directory")  # fmt: skip
    exp.add_argument("--out", required=True, type=Path, help="directory for the Hugging Face model")
    exp.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    exp.add_argument("--hf-config", type=Path, default=None,
                     help="directory with the model's config.json (default: found from the checkpoint)")  # fmt: skip
    exp.add_argument("--shard-size", type=_bytes_arg, default=DEFAULT_SHARD_BYTES,
                     help="max bytes per shard (default 5GB)")  # fmt: skip
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    exp.add_argument("--verbose", action="store_true", help="show Megatron's and transformers' own output")
    _parallel_args(exp)
    exp.set_defaults(func=run_export)


def _finish(summary: ConversionSummary) -> int:
    if _is_rank0():
        for note in summary.notes:
            print(f"note: {note}")
        print(summary.line())
    return 0


def run_import(args: argparse.Namespace) -> int:
    """``nemo llm import``: exit code 0, or :class:`UserError` for bad input."""
    with _quiet_upstream(verbose=getattr(args, "verbose", False)) as say:
        summary = import_hf(args.hf, args.out, verify=args.verify, overwrite=args.overwrite, tolerance=args.tolerance,
                            tp=args.tp, pp=args.pp, ep=args.ep, progress=True, console=say)  # fmt: skip
    return _finish(summary)


def run_export(args: argparse.Namespace) -> int:
    """``nemo llm export``: exit code 0, or :class:`UserError` for bad input."""
    with _quiet_upstream(verbose=getattr(args, "verbose", False)) as say:
        summary = export_hf(args.ckpt, args.out, iteration=args.iteration, overwrite=args.overwrite,
                            hf_config=args.hf_config, shard_bytes=args.shard_size, tp=args.tp, pp=args.pp,
                            ep=args.ep, progress=True, console=say)  # fmt: skip
    return _finish(summary)
