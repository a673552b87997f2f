"""SequentialMLP experts (no grouped GEMM: CPU, or no Transformer Engine) in Megatron Bridge's conversion."""

from __future__ import annotations

from bridge_ext.errors import UserError

__all__ = []


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
