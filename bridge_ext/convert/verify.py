"""``--verify``: the written checkpoint in an fp32 Megatron model against transformers, on the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bridge_ext.convert.fp8 import dequantize_fp8
from bridge_ext.convert.hf_dir import HFSource, inspect_hf_dir
from bridge_ext.convert.megatron_ckpt import _load_model_weights
from bridge_ext.convert.model import _bridge_for, _build_model, _prepare_runtime
from bridge_ext.convert.parallel import _distributed

__all__ = ['VERIFY_TOLERANCE', 'verify_logits']


# summation order (~1e-6 relative per op): the tiny test models measure 0 to 9e-7; for real models with
# 4k-7k hidden sizes and 30-60 layers we expect 1e-5 to 1e-4 (an estimate, not measured here). A wrong
# mapping (swapped gate/up, rope layout, router scoring, expert bias) moves logits by O(0.1-1), so 1e-3
# leaves margin on both sides.
VERIFY_TOLERANCE = 1e-3


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
