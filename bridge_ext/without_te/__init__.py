"""A GPU run on a machine without Transformer Engine: Megatron's own (local) layer spec, no TE kernels.

The recipes target GPUs with TE (``bridge_ext.build.model_provider`` asks for the TE layer spec and TE's fused
kernels). Where TE is not installed (a bare PyTorch image, the GPU tier's lent machine: ``bench/gpu_check.sh``),
``--device gpu`` would fail in the first TE module. Here the model keeps its precision (bf16), process group
(NCCL), parallel sizes, optimizer and data; only what needs TE (or apex) changes, to megatron-core's local
modules, as CPU mode does for its model part (``bridge_ext.cpu.config``). MLA's core attention, which the local
spec cannot build (key and value head sizes differ), is the SDPA attention of :mod:`.sdpa_attention`; the patches
that build MLA and MoE without TE (scope ``without-te``) are :mod:`.patches`, applied by CPU mode and by a GPU run
without TE alike.
Slower than the TE path (unfused attention for GQA, no fused kernels): what it measures is the local path's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TE_KERNEL_SETTINGS", "configure_without_te", "local_layer_spec", "te_checkpoint_keys"]

# Provider settings that need Transformer Engine or apex kernels, and the value megatron-core's local modules run
# with: the part that CPU mode (bridge_ext.cpu.config) and the CPU rehearsal (bridge_ext.rehearse.one_rank) share with
# a GPU run without TE; each adds what its own device needs.
TE_KERNEL_SETTINGS: dict[str, Any] = {
    "transformer_impl": "local",
    "use_transformer_engine_full_layer_spec": False,
    "gradient_accumulation_fusion": False,  # TE / apex fused_weight_gradient_mlp_cuda
    "masked_softmax_fusion": False,  # megatron's scaled_masked_softmax CUDA extension (apex / TE builds)
    "persist_layer_norm": False,  # apex FastLayerNorm
    "apply_rope_fusion": False,  # TE / apex fused RoPE
    "cross_entropy_loss_fusion": False,  # its "te" implementation
    "moe_permute_fusion": False,  # TE's fused token permutation
    "moe_router_fusion": False,  # TE's fused top-k / score function
    "tp_comm_overlap": False,  # TE userbuffers
}

# A GPU run without TE also turns off TE's fp8 recipes and TEGroupedMLP (the local spec then builds SequentialMLP).
_GPU_WITHOUT_TE_SETTINGS: dict[str, Any] = {**TE_KERNEL_SETTINGS, "fp8": None, "moe_grouped_gemm": False}


def local_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """megatron-core's own decoder block spec without Transformer Engine (dense, GQA, QK-norm, MLA, MoE), saving its
    checkpoints under the keys the Transformer Engine spec uses (:func:`te_checkpoint_keys`). Without a query
    low-rank (Moonlight) MLA's ``q_layernorm`` is left out: megatron-core's local spec sets it whenever
    ``qk_layernorm`` is on, 0.16-0.18 never build it there, and 0.19's ``QKNormConfigResolver`` refuses it."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    def without_unused_q_norm(submodules: Any) -> Any:
        attention = getattr(submodules, "self_attention", None)
        inner = getattr(attention, "submodules", None)
        if getattr(config, "q_lora_rank", 0) is not None or not hasattr(inner, "q_layernorm"):
            return submodules
        return dataclasses.replace(submodules, self_attention=dataclasses.replace(
            attention, submodules=dataclasses.replace(inner, q_layernorm=IdentityOp)))

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    layers = [dataclasses.replace(spec, submodules=dataclasses.replace(
        without_unused_q_norm(spec.submodules), sharded_state_dict_keys_map=te_checkpoint_keys(spec.submodules)))
        for spec in block.layer_specs]  # fmt: skip
    return dataclasses.replace(block, layer_specs=layers)


def te_checkpoint_keys(layer: Any) -> dict[str, str]:
    """A local-spec layer's checkpoint key prefixes -> the Transformer Engine spec's, where TE fuses a norm into the
    linear layer after it (``megatron/core/models/gpt/gpt_layer_specs.py``,
    ``get_gpt_layer_with_transformer_engine_spec``):
    GQA's input norm into ``linear_qkv``; MLA's query and key-value latent norms into ``linear_q_up_proj`` and
    ``linear_kv_up_proj`` (its input norm stays a ``TENorm``); a dense MLP's norm into ``linear_fc1`` (an MoE
    layer keeps ``pre_mlp_layernorm``). megatron-core's local spec maps GQA's two norms always, MoE layers too, and
    MLA's none: a checkpoint imported or trained on CPU (local spec) did not load into the TE spec a GPU run builds."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def builds(spec: Any, cls: type) -> bool:  # a ModuleSpec (0.16) or a functools.partial of the class (0.19)
        module = getattr(spec, "module", None) or getattr(spec, "func", None) or spec
        return isinstance(module, type) and issubclass(module, cls)

    keys = ({"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
             "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
            if builds(layer.self_attention, MLASelfAttention)
            else {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})
    if not builds(layer.mlp, MoELayer):
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


def configure_without_te(cfg: Any) -> str:
    """Rewrite ``cfg`` (a ``ConfigContainer``) for a GPU without TE; a console note. The caller applies the
    ``without-te`` patches (``patches.apply("without-te")``: this package sits below the patch registry)."""
    model = cfg.model
    changed = [name for name, value in _GPU_WITHOUT_TE_SETTINGS.items()
               if hasattr(model, name) and getattr(model, name) != value]
    for name in changed:
        setattr(model, name, _GPU_WITHOUT_TE_SETTINGS[name])
    if getattr(model, "moe_token_dispatcher_type", None) == "flex":  # DeepEP / HybridEP need TE's build
        model.moe_token_dispatcher_type = "alltoall"
        changed.append("moe_token_dispatcher_type")
    model.transformer_layer_spec = local_layer_spec
    if cfg.rng is not None:
        cfg.rng.te_rng_tracker = False
    return ("Transformer Engine is not installed: megatron-core's local layer spec on the GPU, "
            f"bf16 kept; off: {', '.join(changed) or 'nothing else'}")
