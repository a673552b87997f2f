"""Hugging Face directories from someone else: the checks that run before anything large is allocated.

:func:`bridge_ext.hf.directory.inspect_hf_dir` is the one entry (every command that reads an HF directory calls it
first); it reads the files through these. Nothing here imports torch or transformers at module level, and nothing
reads more than the bytes it is told to expect:

* JSON files (``config.json``, the shard index) are read only when they are regular files under a size cap;
* ``config.json``'s sizes are whole numbers under caps far above any released model, and the model they describe
  must be about the size of the weights on disk (:func:`check_config_against_weights`), so a config cannot ask
  transformers or Megatron to build something the files do not hold;
* a model-building path (``--no-stream``, a layout, ``--verify``) must fit this machine (:func:`check_model_fits`);
* weights are finite (:func:`check_finite`), checked where conversion already reads each tensor.

Safetensors headers are checked by :func:`bridge_ext.hf.directory.read_safetensors_header` (its cap:
:data:`MAX_HEADER_BYTES`). Each refusal is one :class:`~bridge_ext.errors.UserError` line naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bridge_ext.errors import UserError
from recipes.architecture import Architecture
from recipes.params import count_params

__all__ = ["MAX_HEADER_BYTES", "MAX_INDEX_BYTES", "MAX_JSON_BYTES", "SIZE_CAPS", "check_config_against_weights",
           "check_config_sizes", "check_finite", "check_loaded_finite", "check_model_fits", "machine_memory_bytes",
           "read_json_capped", "regular_file_size"]

# safetensors' own limit on the JSON header (MAX_HEADER_SIZE, safetensors/src/tensor.rs)
MAX_HEADER_BYTES = 100_000_000
# config.json: released ones are 1-10 KB
MAX_JSON_BYTES = 16 * 2**20
# model.safetensors.index.json: ~80 bytes per tensor (Kimi K2's ~140k tensors: ~11 MB)
MAX_INDEX_BYTES = MAX_HEADER_BYTES

# Upper bounds on config.json's sizes: ~100x the largest released model's value (vocabulary 262k, hidden 18k,
# FFN 53k, 126 layers, 128 heads, 384 experts), rounded up. Above them a size is a mistake or an attack.
SIZE_CAPS: dict[str, int] = {
    "vocab_size": 10**8, "hidden_size": 10**7, "intermediate_size": 10**7, "moe_intermediate_size": 10**7,
    "num_hidden_layers": 10**5, "num_attention_heads": 10**5, "num_key_value_heads": 10**5, "head_dim": 10**5,
    "num_experts": 10**5, "n_routed_experts": 10**5, "num_experts_per_tok": 10**5, "n_shared_experts": 10**5,
    "q_lora_rank": 10**7, "kv_lora_rank": 10**7, "qk_nope_head_dim": 10**5, "qk_rope_head_dim": 10**5,
    "v_head_dim": 10**5, "max_position_embeddings": 10**10, "first_k_dense_replace": 10**5, "moe_layer_freq": 10**5,
    "decoder_sparse_step": 10**5, "num_nextn_predict_layers": 10**5, "n_group": 10**5, "topk_group": 10**5,
}  # fmt: skip
_NONZERO = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# Modules a (meta-device) model of the config has: layers x (routed experts + 1). Kimi K2: 61 x 385 = 23k.
_MAX_MODULES = 10**6
# The config's parameter count may exceed what the files hold by this factor (estimate vs storage slack).
_WEIGHTS_SLACK = 2.0


def regular_file_size(file: Path, *, what: str) -> int:
    """The size of ``file`` after following symlinks (the hub cache's ``snapshots/<rev>/x -> ../../blobs/<sha>``);
    a broken link, a directory, a FIFO or a device is refused (reading one could block or never end)."""
    try:
        info = os.stat(file)
    except FileNotFoundError:
        raise UserError(f"{what} {file} is missing (a broken link?)") from None
    except OSError as exc:
        raise UserError(f"{what} {file} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{what} {file} is not a regular file")
    return info.st_size


def read_json_capped(file: Path, *, limit: int = MAX_JSON_BYTES, what: str = "") -> Any:
    """``file`` parsed as JSON, refused in one line when it is not a regular file, is over ``limit`` bytes, or
    does not parse (deep nesting and 10^5-digit numbers included)."""
    size = regular_file_size(file, what=what or "file")
    if size > limit:
        raise UserError(f"{file} is {size:,} bytes, over the {limit:,} this file may have; refused unread")
    with open(file, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:  # grew since the stat
        raise UserError(f"{file} is over the {limit:,} bytes this file may have; refused")
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise UserError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: int digit limit
        raise UserError(f"{file} is not valid JSON ({type(exc).__name__})") from None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_sizes(raw: Mapping[str, Any], *, where: Path) -> None:
    """``config.json``'s sizes are whole numbers, not negative, under :data:`SIZE_CAPS`; the core four not zero;
    layers x experts under a module bound. Runs before transformers builds anything from them."""
    for key, cap in SIZE_CAPS.items():
        value = raw.get(key)
        if value is None:
            continue
        if not _whole(value) or value < 0:
            raise UserError(f"{where}: {key} is {value!r}; it must be a whole number >= 0")
        if value == 0 and key in _NONZERO:
            raise UserError(f"{where}: {key} is 0")
        if value > cap:
            raise UserError(f"{where}: {key} is {value:,}, over the {cap:,} any model could have; refused before "
                            "building anything from it")
    only = raw.get("mlp_only_layers")
    if only is not None and (not isinstance(only, list) or len(only) > SIZE_CAPS["num_hidden_layers"]
                             or not all(_whole(v) and v >= 0 for v in only)):  # fmt: skip
        raise UserError(f"{where}: mlp_only_layers must be a list of layer numbers")
    layers = raw.get("num_hidden_layers") or 1
    experts = raw.get("n_routed_experts") or raw.get("num_experts") or 0
    if layers * (experts + 1) > _MAX_MODULES:
        raise UserError(f"{where}: {layers:,} layers x {experts:,} experts is over {_MAX_MODULES:,} modules; "
                        "refused before building anything from it")


def _human(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _count(parameters: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.2f}{unit}"
    return str(parameters)


def check_config_against_weights(arch: Architecture, *, stored_bytes: int, bytes_per_param: float,
                                 where: Path) -> int:
    """The parameters ``config.json`` describes (``arch``: :func:`recipes.params.count_params`); refused when they
    need more than :data:`_WEIGHTS_SLACK` x the bytes the safetensors headers hold (each header checked against
    its file's size) at the checkpoint's smallest storage, ``bytes_per_param`` (2 for bf16, 1 for fp8, 0.5 for
    int4). So whatever a config claims, a model built from it is bounded by the files on disk."""
    parameters = count_params(arch).total
    needed = parameters * bytes_per_param
    if needed > _WEIGHTS_SLACK * stored_bytes + 2**20:
        raise UserError(
            f"{where} describes a {_count(parameters)}-parameter model ({_human(needed)} at {bytes_per_param:g} "
            f"bytes per parameter; vocab_size {arch.vocab_size:,}, hidden_size {arch.hidden_size:,}, "
            f"{arch.num_layers:,} layers), but its safetensors hold {_human(stored_bytes)}; the sizes do not "
            "match the weights"
        )
    return parameters


def machine_memory_bytes() -> int:
    """This machine's physical memory (``sysconf``: what ``/proc/meminfo``'s MemTotal says)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_model_fits(*, parameters: int, bytes_per_param: int, processes: int, what: str, hint: str,
                     where: Path, memory: int | None = None) -> None:
    """Refuse a path that builds the model when even its lower bound, ``parameters x bytes_per_param / processes``
    per process, exceeds this machine's memory (``memory``, default :func:`machine_memory_bytes`). Generous on
    purpose: on GPUs the weights live in GPU memory, but a rank's share larger than the whole host is absurd."""
    memory = machine_memory_bytes() if memory is None else memory
    per_process = parameters * bytes_per_param / max(processes, 1)
    if per_process > memory:
        per = f" per process ({processes} processes)" if processes > 1 else ""
        raise UserError(f"{where} describes a {_count(parameters)}-parameter model: {what} needs at least "
                        f"{_human(per_process)}{per}, this machine has {_human(memory)} of memory; {hint}")


def _first_bad(tensor: Any) -> tuple[int, str] | None:
    """Flat index and kind of the first non-finite element, scanning 1M-element chunks (exact, bounded memory)."""
    import torch

    rows = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
    step = 1 << 20
    for start in range(0, rows.numel(), step):
        chunk = rows[start : start + step].float()
        if bool(torch.isfinite(chunk.sum())):
            continue
        bad = (~torch.isfinite(chunk)).nonzero()
        if len(bad):  # else finite values whose sum overflowed
            i = int(bad[0, 0])
            return start + i, "NaN" if bool(torch.isnan(chunk[i])) else "Inf"
    return None


def check_finite(tensor: Any, *, name: str, file: Path) -> None:
    """Refuse ``tensor`` (the HF tensor ``name`` of ``file``) when it holds a NaN or an Inf.

    One ``sum`` (a NaN or Inf anywhere makes it non-finite; no temporary the size of the tensor; ~17-27 GB/s on
    this project's 2-core machine, against 0.3 GB/s for ``isfinite(t).all()`` on bf16); only a non-finite sum is
    scanned exactly (finite values whose sum overflows pass)."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    total = tensor.sum(dtype=torch.float32) if tensor.element_size() == 1 else tensor.sum()
    if bool(torch.isfinite(total)):
        return
    found = _first_bad(tensor)
    if found is not None:
        index, kind = found
        raise UserError(f"{file}: tensor {name} has {kind} at element {index:,} of {tensor.numel():,} "
                        f"(shape {list(tensor.shape)}); refusing weights that are not finite")


def check_loaded_finite(loaded: Any, hf_param: str | Mapping[str, str], *, source: Any) -> None:
    """:func:`check_finite` on what a mapping's load hook returned for ``hf_param`` (a tensor for a name, a dict
    for a dict of names) from the HF directory ``source`` (:class:`~bridge_ext.hf.directory.HFSource`); the file
    named is the one that stores the tensor."""
    pairs = [(hf_param, loaded)] if isinstance(hf_param, str) else [(hf_param[k], v) for k, v in loaded.items()]
    for name, tensor in pairs:
        info = source.tensors.get(source.stored_name(name))
        check_finite(tensor, name=name, file=source.path / info.file if info is not None else source.path)
