"""``--verify``: the written checkpoint in an fp32 Megatron model against transformers, on the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bridge_ext.convert.megatron_ckpt import find_iteration, load_model_weights
from bridge_ext.convert.model import bridge_for, build_model, prepare_runtime
from bridge_ext.convert.parallel import process_group
from bridge_ext.convert.report import say_on_rank0
from bridge_ext.errors import UserError
from bridge_ext.hf.directory import HFSource, model_tensor_shapes, inspect_hf_dir
from bridge_ext.hf.expert_layout import assemble, expert_layout
from bridge_ext.hf.read import HFTensorReader

__all__ = ['VERIFY_TOLERANCE', 'verify_import', 'verify_logits']


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
    cpu = prepare_runtime() if cpu is None else cpu
    device = "cpu" if cpu else f"cuda:{torch.cuda.current_device()}"
    tokens = _verify_tokens(source.config.vocab_size)

    with process_group(cpu):
        bridge = bridge_for(source.config, model_type=source.raw_config.get("model_type"))
        model = build_model(bridge, cpu=cpu, dtype=torch.float32)
        load_model_weights(Path(iter_dir), model)
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
    """The source as a transformers model in fp32 (eager attention), loaded by transformers' ``from_pretrained``
    wherever it can: a per-expert checkpoint under any transformers (5 fuses experts on load), a fused one where
    the installed model is fused too. fp8 and int4 sources (transformers would quantize on load) and fused
    checkpoints under a per-expert transformers are read here: dequantized like the import, experts assembled to
    the installed model's layout (:mod:`~bridge_ext.hf.expert_layout`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_layout = expert_layout(model_tensor_shapes(source.config))
    if not (source.fp8 or source.int4) and source.expert_layout in ("none", "per_expert", model_layout):
        return AutoModelForCausalLM.from_pretrained(
            str(source.path), config=source.config, dtype=torch.float32, attn_implementation="eager",
            use_safetensors=True,  # never a pytorch_model.bin (a pickle) beside them
        )
    model = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32, attn_implementation="eager")
    reader = HFTensorReader(source, dequantize=True)
    with torch.no_grad():
        for name, target in model.state_dict().items():
            try:
                tensor = assemble(name, tuple(target.shape), reader.read)
            except KeyError:  # not stored: tied lm_head, rotary buffers
                continue
            target.copy_(tensor.to(torch.float32))
    reader.close()
    return model


def verify_import(staging: Path, hf: Path, *, source: HFSource, cpu: bool, tolerance: float, target: Path,
                  console: Any) -> float:
    """``import --verify``: transformers' logits vs the staged checkpoint's, in fp32 (:func:`verify_logits`); past
    ``tolerance`` a one-line error, and the staging directory is never renamed into ``target``."""
    iter_dir, _ = find_iteration(staging)
    say_on_rank0(console, "verifying: transformers vs Megatron logits in fp32")
    difference = verify_logits(hf, iter_dir, source=source, cpu=cpu)
    if not difference <= tolerance:
        raise UserError(f"verification failed: max |logit difference| {difference:.3e} exceeds the tolerance "
                        f"{tolerance:.0e}; nothing was written to {target}")
    return difference
