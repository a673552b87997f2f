"""Block-quantized fp8 (e4m3 + ``weight_scale_inv``) releases of DeepSeek-V3 / Kimi K2: dequantized on import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bridge_ext.hf.directory import HFSource

__all__ = ["dequantize_fp8", "fp8_dequantizing"]


def dequantize_fp8(weight: Any, scale_inv: Any, block: tuple[int, int]) -> Any:
    """Block-quantized fp8 -> bf16: ``W = W_fp8 * scale_inv`` per ``block`` (rows x cols) tile.

    The layout of DeepSeek-V3 / Kimi K2 releases: ``W_scale_inv`` has shape
    ``ceil(rows / block[0]) x ceil(cols / block[1])`` (DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``).
    """
    import torch

    rows, cols = weight.shape
    scale = scale_inv.to(torch.float32)
    per_row = scale.repeat_interleave(block[0], 0)[:rows]  # [rows, column blocks]: 1/block[1] of the weight
    if cols % block[1] == 0:  # the scale broadcast over each row's column blocks, never materialized (2x faster)
        out = weight.to(torch.float32).view(rows, cols // block[1], block[1]).mul_(per_row.unsqueeze(-1))
        return out.view(rows, cols).to(torch.bfloat16)
    full = per_row.repeat_interleave(block[1], 1)[:, :cols]
    return (weight.to(torch.float32) * full).to(torch.bfloat16)


def fp8_dequantizing(load: Callable[..., Any], source: HFSource) -> Callable[..., Any]:
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
