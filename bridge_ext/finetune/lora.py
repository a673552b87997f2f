"""LoRA adapters merged into the base weights, saved as a plain Megatron checkpoint for ``nemo llm export``.

Megatron Bridge's PEFT checkpoints hold the adapters (the base stays in ``pretrained_checkpoint``). At the end
of a LoRA run on one process the merged model, ``W + alpha/dim * B @ A`` (Megatron Bridge's ``LoRAMerge.merge``)
for every ``LoRALinear``, is copied into a fresh model of the same provider (no adapters) and saved with
Megatron Bridge's ``save_megatron_model`` to ``<checkpoint.save>/merged``; ``nemo llm export --ckpt
<checkpoint.save>/merged --out DIR`` converts it like any other checkpoint. The training model is not
modified (the final validation still runs on base + adapters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MERGED_DIR", "merged_lora_saver", "merged_state_dict"]

MERGED_DIR = "merged"


def merged_state_dict(chunk: Any) -> dict[str, Any]:
    """The chunk's weights with every LoRA adapter merged, under the names of the same model without adapters."""
    import torch
    from megatron.bridge.peft.lora_layers import LoRALinear

    from bridge_ext.upstream_api import lora_merge

    merge, unsharded = lora_merge()
    merged = {}
    with torch.no_grad():
        for name, module in chunk.named_modules():
            if isinstance(module, LoRALinear) and hasattr(module.to_wrap, "weight"):
                adapter = module.adapter
                weight = merge.merge(module.to_wrap.weight, adapter.linear_out.weight, adapter.linear_in.weight,
                                     adapter.alpha, adapter.dim, **unsharded).detach().clone()
                # AdapterWrapper's state_dict names the base weight without ``to_wrap`` (checkpoint-compatible)
                merged[f"{name}.weight"] = merged[f"{name}.to_wrap.weight"] = weight
        state, used = {}, 0
        for key, value in chunk.state_dict().items():
            if ".adapter." in key:
                continue
            if key in merged:
                value, used = merged[key], used + 1
            state[key.replace(".to_wrap.", ".")] = value
    if used != len(merged) // 2:
        raise RuntimeError(f"merged {used} of {len(merged) // 2} LoRA weights into the state dict")
    return state


# What Megatron Bridge's training setup hangs on the model config (gradient finalization, loss scaling, overlap
# hooks): bound to the run's process groups and optimizer, they cannot be deep-copied.
_TRAINING_HOOKS = ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
                   "param_sync_func")


def _training_free_provider(provider: Any) -> Any:
    """A shallow copy of the run's model provider without its training hooks, to build a plain model from.

    megatron-core's ``SequentialMLP`` deep-copies its config when ``moe_ffn_hidden_size != ffn_hidden_size``
    (``transformer/moe/experts.py``), as in Kimi K2 / DeepSeek-V3: with the hooks still attached that copy
    fails on a ``ProcessGroup`` ("cannot pickle").
    """
    import copy

    plain = copy.copy(provider)
    for hook in _TRAINING_HOOKS:
        if getattr(plain, hook, None) is not None:
            setattr(plain, hook, None)
    return plain


def merged_lora_saver(out: Path, *, tokenizer_dir: Path | None):
    """A callback writing the merged model to ``out`` when training ends (one process: TP = PP = EP = 1)."""
    from megatron.bridge.training.callbacks import Callback

    class MergedLoRASave(Callback):
        def on_train_end(self, context):
            from megatron.bridge.training.model_load_save import save_megatron_model
            from megatron.core.utils import unwrap_model

            (chunk,) = unwrap_model(context.model)
            state = merged_state_dict(chunk)
            plain = _training_free_provider(context.state.cfg.model).provide(pre_process=True, post_process=True)
            missing, unexpected = plain.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(f"merged LoRA weights do not fit the base model: missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]}")
            save_megatron_model([plain], str(out), hf_tokenizer_path=str(tokenizer_dir) if tokenizer_dir else None)

    return MergedLoRASave()


__all__ += ["muon_without_adam_part"]


def muon_without_adam_part() -> None:
    """Muon over LoRA adapters: drop the empty Adam part megatron-core chains in (the ``muon-lora-no-empty-adam``
    patch, ``bridge_ext.patches.optimizer``; process-wide, idempotent).

    ``megatron/core/optimizer/muon.py`` ``get_megatron_muon_optimizer`` (0.16) always chains the Adam optimizer
    of the non-matrix parameters; when every trainable parameter is a matrix (LoRA: only the adapters' A and B
    train) that part wraps ``None`` and the first checkpoint save fails in its ``state_dict``.
    """
    from bridge_ext import patches

    patches.apply("lora-muon")
