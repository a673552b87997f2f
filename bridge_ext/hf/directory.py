"""Reading and validating Hugging Face model directories: config, safetensors headers, shards, dtypes."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from bridge_ext.hf.expert_layout import (
    ExpertLayout,
    ExpertSlice,
    expert_layout,
    fused_shapes,
    per_expert_shapes,
    per_expert_views,
)
from bridge_ext.hf.int4 import COMPANIONS as INT4_COMPANIONS
from bridge_ext.hf.int4 import Int4Scheme, int4_scheme, int4_weights
from bridge_ext.hf.untrusted import (
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    check_config_against_weights,
    check_config_sizes,
    read_json_capped,
    regular_file_size,
)
from recipes.architecture import Architecture
from recipes.families import FAMILIES, ModelFamily, families_of_architecture, family

__all__ = ["CONVERSION_RECORD", "FLOAT_ST", "HF_SOURCE_DIR", "SAFETENSORS_DTYPES", "TORCH_TO_ST", "HFSource",
           "TensorInfo", "architecture_of", "config_from_dir", "convertible_family", "copy_side_files",
           "expected_hf_tensors", "hf_tokenizer_loadable", "inspect_hf_dir", "model_tensor_shapes",
           "read_safetensors_header", "supported_architectures", "write_hf_source"]


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


SAFETENSORS_DTYPES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
TORCH_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
FLOAT_ST = {"F64", "F32", "F16", "BF16"}
_FP8_ST = {"F8_E4M3", "F8_E5M2"}


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
    architecture: str  # the HF class (config.json's `architectures` entry) Megatron Bridge converts it with
    family: ModelFamily  # its model_type's entry in recipes.families.FAMILIES
    tensors: dict[str, TensorInfo]
    files: list[str]
    dtype: str  # the weights' dtype as a torch dtype name ("bfloat16", ...)
    fp8: bool = False  # block-quantized fp8 weights with *_scale_inv tensors (dequantized on import)
    fp8_block: tuple[int, int] = (128, 128)  # quantization_config.weight_block_size
    expert_layout: ExpertLayout = "none"  # routed experts stored per expert or fused (bridge_ext.hf.expert_layout)
    # Per-expert name -> its place in a fused tensor (fused checkpoints only): what conversion reads.
    expert_views: dict[str, ExpertSlice] = field(default_factory=dict)
    # compressed-tensors int4 (bridge_ext.hf.int4): ``X.weight`` -> its unpacked shape, read dequantized from
    # ``X.weight_packed`` / ``weight_scale`` / ``weight_shape``
    int4: Int4Scheme | None = None
    int4_weights: dict[str, tuple[int, ...]] = field(default_factory=dict)
    parameters: int = 0  # what config.json describes (recipes.params.count_params), checked against the files

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def stored_name(self, name: str) -> str:
        """The tensor on disk that holds ``name`` (a per-expert name of a fused checkpoint: the fused tensor; an int4
        weight: its packed values)."""
        view = self.expert_views.get(name)
        if name in self.int4_weights:
            return f"{name}_packed"
        return view.fused if view is not None else name

    def companions(self, stored: str) -> list[str]:
        """The other stored tensors read with ``stored``: fp8 block scales, int4 scales and shape."""
        if stored.endswith(".weight_packed"):
            module = stored[: -len(".weight_packed")]
            return [f"{module}.weight_scale", f"{module}.weight_shape"]
        return [f"{stored}_scale_inv"] if f"{stored}_scale_inv" in self.tensors else []

    def readable(self) -> list[str]:
        """The names conversion reads: stored tensors, per-expert views of fused ones, dequantized int4 weights."""
        hidden = {view.fused for view in self.expert_views.values()}
        hidden |= {f"{w}_{part.removeprefix('weight_')}" for w in self.int4_weights for part in INT4_COMPANIONS}
        return [n for n in self.tensors if n not in hidden] + list(self.expert_views) + list(self.int4_weights)


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header against its size, reading only the header.

    Format: 8-byte little-endian header length, a JSON header, then the data buffer that the header's
    ``data_offsets`` must cover exactly, without gaps or overlaps (https://github.com/huggingface/safetensors#format;
    what safetensors' own ``Metadata::validate`` requires). The length is checked against the file and
    :data:`~bridge_ext.hf.untrusted.MAX_HEADER_BYTES` before the header is read; a header that claims more
    bytes than the file is "truncated".
    """
    where = f"{file.parent.name}/{file.name}"
    size = regular_file_size(file, what="safetensors file")
    if size < 8:
        raise UserError(f"{where} is truncated ({size} bytes); re-download or re-save it")
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
            raise UserError(f"{where} is not a valid safetensors file (header length {header_len:,}, file "
                            f"{size:,} bytes, at most {MAX_HEADER_BYTES:,}); refused unread")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise UserError(f"{where} is corrupt: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise UserError(f"{where} is corrupt: its safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise UserError(f"{where} is corrupt: its __metadata__ is not a map of strings")
    data_len = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        try:
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            begin, end = offsets
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{where} is corrupt: bad header entry for tensor {name}") from None
        if not (isinstance(shape, list) and all(_whole(d) and d >= 0 for d in shape)
                and _whole(begin) and _whole(end) and 0 <= begin <= end):  # fmt: skip
            raise UserError(f"{where} is corrupt: tensor {name} has shape {shape!r} and data_offsets {offsets!r}")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"{where}: tensor {name} has dtype {dtype!r}, which conversion cannot take "
                            f"(known: {', '.join(SAFETENSORS_DTYPES)})")
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if end - begin != expected:
            raise UserError(f"{where} is corrupt: tensor {name} spans {end - begin} bytes, its shape needs {expected}")
        if end > data_len:
            raise UserError(
                f"{where} is truncated: tensor {name} ends at byte {end:,} of a {data_len:,}-byte data section; "
                "re-download or re-save it"
            )
        spans.append((begin, end, name))
        tensors[name] = TensorInfo(file=file.name, dtype=dtype, shape=tuple(shape), nbytes=expected)
    cursor, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < cursor:
            raise UserError(f"{where} is corrupt: tensors {previous} and {name} overlap (bytes {begin:,}-{cursor:,})")
        if begin > cursor:
            raise UserError(f"{where} is corrupt: {begin - cursor:,} bytes before tensor {name} belong to no tensor")
        cursor, previous = end, name
    if cursor != data_len:
        raise UserError(f"{where} is corrupt: {data_len - cursor} bytes after the last tensor")
    return tensors


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def expected_hf_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of the architecture holds (name -> shape), routed experts per expert.

    From the installed transformers' model, built on the meta device; where that model fuses expert weights
    (transformers 5) they are listed as the per-expert tensors of released checkpoints
    (:mod:`~bridge_ext.hf.expert_layout`), so the list is the same under every transformers.
    """
    return per_expert_shapes(model_tensor_shapes(config))


def model_tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The installed transformers model's own state dict (name -> shape), built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # `dtype`: transformers >= 4.56
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in state.items()}



def _st_to_torch_name(code: str) -> str:
    return {v: k for k, v in TORCH_TO_ST.items()}.get(code, code.lower())


def supported_architectures() -> list[str]:
    """The HF classes conversion accepts: those of :data:`recipes.families.FAMILIES`, in its order."""
    return list(dict.fromkeys(f.hf_architecture for f in FAMILIES.values()))


def convertible_family(raw: dict[str, Any], *, where: Path) -> ModelFamily:
    """The family of a ``config.json`` (``raw``, read from ``where``): its ``architectures`` name a family's HF
    class and its ``model_type`` is that family. Anything else is a :class:`UserError` that says what is supported.

    Decided from recipe data (:data:`recipes.families.FAMILIES`) before transformers is imported.
    """
    architectures = raw.get("architectures") or []
    supported = supported_architectures()
    architecture = next((a for a in architectures if a in supported), None)
    model_type = raw.get("model_type")
    if architecture is None:
        from bridge_ext.errors import closest

        name = architectures[0] if architectures else f"model_type {model_type!r}"
        hint = closest(str(name), supported)
        raise UserError(f"unsupported architecture {name}{hint}; supported: {', '.join(supported)}")
    known = family(model_type)
    if known is None or known.hf_architecture != architecture:
        types = ", ".join(f.model_type for f in families_of_architecture(architecture))
        raise UserError(f"{where}: architecture {architecture} with model_type {model_type!r} is not supported "
                        f"(model_types of {architecture}: {types})")
    return known


def architecture_of(config: Any, raw: dict[str, Any]) -> Architecture:
    """The recipes' :class:`~recipes.architecture.Architecture` of a checkpoint: its ``config.json`` (``raw``),
    keys it leaves out at the transformers ``config``'s defaults."""
    return Architecture.from_hf_config({**config.to_dict(), **raw})


def inspect_hf_dir(path: str | Path, *, check_tensors: bool = True) -> HFSource:
    """Validate a Hugging Face checkpoint directory; raise :class:`UserError` naming the first problem.

    The one check of a directory from someone else (docs/conversion.md, "Hugging Face directories from someone
    else"): every file it reads is a regular file (symlinks followed), JSON under a size cap, safetensors headers
    checked against their files before they are read, ``config.json``'s sizes capped and matched against the bytes
    on disk (:mod:`~bridge_ext.hf.untrusted`) before transformers builds a config or a meta-device model from it.
    """
    from bridge_ext.hf.config import load_hf_config

    path = Path(path)
    if not path.exists():
        raise UserError(f"--hf {path} does not exist")
    if not path.is_dir():
        raise UserError(f"--hf {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} has no config.json; point --hf at a Hugging Face model directory")
    raw = read_json_capped(config_file, what="config.json")
    if not isinstance(raw, dict):
        raise UserError(f"{config_file} is not a JSON object")
    model_family = convertible_family(raw, where=config_file)
    architecture = model_family.hf_architecture
    check_config_sizes(raw, where=config_file)
    try:
        config = load_hf_config(path)
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        model_type = raw.get("model_type")
        raise UserError(
            f"{config_file}: transformers cannot build a config for model_type {model_type!r} ({first})"
        ) from None

    # Shards: the index, if any, names them; otherwise every *.safetensors in the directory.
    index_file = path / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index_file.exists() or index_file.is_symlink():
        index = read_json_capped(index_file, limit=MAX_INDEX_BYTES, what="model.safetensors.index.json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):  # fmt: skip
            raise UserError(f"{index_file} is corrupt (no valid weight_map)")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if Path(f).name != f or f in (".", "..") or not f.endswith(".safetensors")]
        if outside:
            raise UserError(f"{index_file} names {outside[0]!r}, which is not a .safetensors file of {path}")
        missing = [f for f in files if not (path / f).exists()]  # a FIFO or a directory: refused below
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise UserError(f"{path}: shard {missing[0]}{more} listed in model.safetensors.index.json is missing")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
                raise UserError(f"{path} has only PyTorch .bin/.pt weights (pickles, never read here); save it "
                                "with safe_serialization=True")
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
    int4 = int4_scheme(quant, where=config_file)
    parameters = check_config_against_weights(
        architecture_of(config, raw), stored_bytes=sum(t.nbytes for t in tensors.values()),
        bytes_per_param=_smallest_storage(tensors, fp8=fp8, int4=int4 is not None), where=config_file)  # fmt: skip
    expected = expected_hf_tensors(config) if check_tensors else None
    int4_shapes = {} if int4 is None else int4_weights(
        {k: v.shape for k, v in tensors.items()}, {k: v.dtype for k, v in tensors.items()}, int4,
        expected=expected, where=path)  # fmt: skip
    # int4's packed tensors stand for float weights: checked (above) and sized as those
    packed = {f"{w}_{part.removeprefix('weight_')}" for w in int4_shapes for part in INT4_COMPANIONS}
    as_float = {k: v for k, v in tensors.items() if k not in packed}
    for name, shape in int4_shapes.items():
        as_float[name] = TensorInfo(file=tensors[f"{name}_packed"].file, dtype=TORCH_TO_ST.get(
            str(declared or "bfloat16").replace("torch.", ""), "BF16"), shape=shape, nbytes=0)
    dtype = _check_dtypes(path, as_float, declared=declared, fp8=fp8)

    try:
        layout = expert_layout(as_float)
    except ValueError as exc:
        raise UserError(f"{path} {exc}; convert it from one consistent checkpoint") from None
    views = per_expert_views({k: v.shape for k, v in tensors.items()}) if layout == "fused" else {}
    if expected is not None:
        if layout == "fused":  # saved by transformers 5 with save_original_format=False
            expected = fused_shapes(expected)
        missing = [k for k in expected if k not in as_float]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UserError(f"{path}: tensor {missing[0]}{more} is missing for {architecture}; is a shard incomplete?")
        for key, shape in expected.items():
            if as_float[key].shape != shape:
                raise UserError(
                    f"{path}: tensor {key} has shape {list(as_float[key].shape)}, config.json implies {list(shape)}"
                )
    block = tuple(quant.get("weight_block_size") or (128, 128))
    if fp8 and (len(block) != 2 or quant.get("fmt", "e4m3") != "e4m3"):
        raise UserError(f"{config_file}: only e4m3 fp8 with 2-D weight_block_size is supported, got {quant}")
    return HFSource(path=path, raw_config=raw, config=config, architecture=architecture, family=model_family,
                    tensors=tensors, files=files, dtype=dtype, fp8=fp8, fp8_block=block, expert_layout=layout,
                    expert_views=views, int4=int4, int4_weights=int4_shapes, parameters=parameters)  # fmt: skip


def _smallest_storage(tensors: dict[str, TensorInfo], *, fp8: bool, int4: bool) -> float:
    """Bytes per parameter of the checkpoint's most compact weights: 0.5 (int4 packed), 1 (fp8), else the
    smallest float dtype it stores (2 for bf16, 4 for fp32)."""
    if int4:
        return 0.5
    if fp8:
        return 1.0
    floats = [SAFETENSORS_DTYPES[t.dtype] for t in tensors.values() if t.dtype in FLOAT_ST | _FP8_ST]
    return float(min(floats, default=2))


def _check_dtypes(path: Path, tensors: dict[str, TensorInfo], *, declared: str | None, fp8: bool) -> str:
    """The weights' dtype; a UserError when tensors disagree with each other or with config.json.

    Matrices must all have one dtype, the declared ``torch_dtype`` when config.json has one (or fp8 when it
    declares fp8 quantization). Vectors (norms, biases) may also be float32, as DeepSeek-V3 releases keep
    ``e_score_correction_bias``.
    """
    matrix_dtypes: dict[str, str] = {}
    for key, info in tensors.items():
        if info.dtype not in FLOAT_ST | _FP8_ST:
            raise UserError(f"{path}: tensor {key} has dtype {info.dtype}; weights must be floating point")
        if fp8 and key.endswith("_scale_inv"):
            continue
        if len(info.shape) >= 2:
            matrix_dtypes.setdefault(info.dtype, key)
    if fp8:
        wanted = {"F8_E4M3"}
        others = {d: k for d, k in matrix_dtypes.items() if d not in wanted | FLOAT_ST}
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
        want = TORCH_TO_ST.get(str(declared).replace("torch.", ""))
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


def copy_side_files(source: Path, dest: Path) -> list[str]:
    """Copy tokenizer / generation / remote-code files (never weights, never config.json)."""
    copied = []
    for pattern in _SIDE_FILE_PATTERNS:
        for file in sorted(source.glob(pattern)):
            if file.is_file() and file.name != "config.json" and not (dest / file.name).exists():
                shutil.copy2(file, dest / file.name)
                copied.append(file.name)
    return copied


def write_hf_source(hf: Path, staging: Path, source: HFSource) -> None:
    """An import's ``hf_source/``: config.json's bytes, the tokenizer / generation files and the conversion record
    (what export and run recognition read back)."""
    side = staging / HF_SOURCE_DIR
    side.mkdir()
    shutil.copy2(hf / "config.json", side / "config.json")
    copy_side_files(hf, side)
    record = {
        "direction": "import",
        "source": str(hf.absolute()),
        "architecture": source.architecture,
        "dtype": source.dtype,
        "fp8_source": source.fp8,
        "tensors": {k: v.dtype for k, v in sorted(source.tensors.items())},
    }
    (side / CONVERSION_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def hf_tokenizer_loadable(path: Path) -> bool:
    """True when transformers can load the tokenizer at ``path`` without remote code."""
    config_file = path / "tokenizer_config.json"
    if not any((path / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        return False
    if config_file.is_file():
        with contextlib.suppress(Exception):
            if "auto_map" in json.loads(config_file.read_text()):
                return False
    return True


def config_from_dir(path: Path) -> tuple[Any, ModelFamily, dict[str, Any]]:
    """Config, family and raw dict of a config-only directory (no weights to validate)."""
    from bridge_ext.hf.config import load_hf_config

    raw = read_json_capped(path / "config.json", what="config.json")
    if not isinstance(raw, dict):
        raise UserError(f"{path}/config.json is not a JSON object")
    model_family = convertible_family(raw, where=path / "config.json")
    check_config_sizes(raw, where=path / "config.json")
    return load_hf_config(path), model_family, raw
