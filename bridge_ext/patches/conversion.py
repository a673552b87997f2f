"""Conversion patches (scope ``conversion``): SequentialMLP experts (no grouped GEMM: CPU, or no Transformer
Engine) in Megatron Bridge's HF <-> Megatron conversion.

* ``deepseek-sequential-expert-mappings``: the DeepSeek-V3 bridge (Kimi K2's) maps only grouped-GEMM expert names.
* ``kimi-k2-bridge-mappings``: the same for megatron-bridge >= 0.4's own ``KimiK2Bridge``, and its router's
  expert bias, where its DeepSeek mapping list lacks them (0.4.2).
* ``sequential-expert-export``: exporting ``local_experts.<N>`` fails on ``int('')``; with EP > 1 experts are
  gathered with their global numbers.
* ``sequential-expert-numbers``: under EP > 1 a SequentialMLP expert keeps its local number.

The last two step aside where upstream fixed them (megatron-bridge >= 0.4 reads ``local_experts.<N>`` in
``gather_from_ep_ranks``; >= 0.6 also globalizes it), decided from the installed code.

MLA's fixes that conversion and training share (the latent norms' eps, Moonlight's query without a low rank) are
``bridge_ext.patches.transformer``'s: they change megatron-core's attention, whoever builds it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from typing import Any

from bridge_ext.stack import UpstreamDrift, module_source, package_of
from bridge_ext.upstream_patch import Patch

__all__ = ["PATCHES"]


def _deepseek_maps_no_sequential_experts() -> bool:
    return "local_experts" not in module_source("megatron.bridge.models.deepseek.common")


def _with_sequential_expert_mappings(original: Callable) -> Callable:
    """``DeepSeekV3Bridge.mapping_registry`` that also maps the SequentialMLP (``local_experts``) parameter names.

    ``megatron/bridge/models/deepseek/common.py:103,132-136`` (megatron-bridge 0.3.1) map only the grouped-GEMM
    expert names (``mlp.experts.linear_fc1.weight<N>``). Without Transformer Engine or on CPU, experts are a
    SequentialMLP (``mlp.experts.local_experts.<N>.linear_fc1.weight``); ``build_conversion_tasks``
    (``model_bridge.py:1205``) then skips them with a warning, so they would be neither loaded nor exported.
    Qwen3-MoE's bridge already has both sets (``qwen/qwen3_moe_bridge.py:110-118``); this adds the same two.
    """
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

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

    return mapping_registry


def _sequential_expert_export(original: Callable) -> Callable:
    """``MegatronParamMapping.gather_from_ep_ranks`` that exports SequentialMLP experts (``local_experts.<N>``),
    with any expert-parallel size.

    ``megatron/bridge/models/conversion/param_mapping.py:674-678`` (megatron-bridge 0.3.1, ``gather_from_ep_ranks``)
    reads the expert number from the text after ``.weight`` (grouped-GEMM names ``linear_fc1.weight<N>``);
    for ``local_experts.<N>.linear_fc1.weight`` that text is empty and ``int('')`` raises. With one EP rank
    there is nothing to gather: the weight is the HF expert's. With EP > 1 each rank of the EP group holds
    another expert at this point of the (identically ordered) export: the tensors are all-gathered with the
    global expert numbers they belong to (``sequential-expert-numbers``), so every rank
    yields every expert under its own HF name, whatever order the ranks' tasks were sorted in.
    """
    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):
        if ".local_experts." not in self.megatron_param:
            return original(self, megatron_weights, megatron_module, hf_param_name)
        if self.ep_size == 1:
            return {str(hf_param_name): megatron_weights}
        import torch

        number = int(_LOCAL_EXPERT.search(self.megatron_param).group(1))  # global: see the renaming below
        numbers: list[Any] = [None] * self.ep_size
        torch.distributed.all_gather_object(numbers, number, group=self.ep_group)
        gathered = [torch.empty_like(megatron_weights) for _ in range(self.ep_size)]
        torch.distributed.all_gather(gathered, megatron_weights.contiguous(), group=self.ep_group)
        return {_HF_EXPERT.sub(str(n), str(hf_param_name), count=1): w for n, w in zip(numbers, gathered)}

    return gather_from_ep_ranks


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_HF_EXPERT = re.compile(r"(?<=\.experts\.)\d+")  # model.layers.L.mlp.experts.<N>.gate_proj.weight


def _global_sequential_expert_numbers(original: Callable) -> Callable:
    """``model_bridge._megatron_local_name_to_global`` that names SequentialMLP experts by their global number
    under expert parallelism.

    ``megatron/bridge/models/conversion/model_bridge.py`` ``_megatron_local_name_to_global`` (lines 146-166 in
    megatron-bridge 0.3.1) turns a grouped-GEMM expert's local number (``linear_fc1.weight<N>``) into the
    global one, but leaves ``local_experts.<N>`` alone: with ``--ep 2`` the second rank's expert 0 would be
    loaded from, and exported as, HF expert 0 instead of ``num_experts / 2``. Here the local number becomes
    ``experts_per_rank * ep_rank + N``, as upstream does for grouped GEMM; the module is still looked up by its
    local name (``build_conversion_tasks`` keeps both).
    """
    from megatron.core import parallel_state

    def _megatron_local_name_to_global(models, config, param_name, vp_stage=None):
        name = original(models, config, param_name, vp_stage)
        match = _LOCAL_EXPERT.search(name)
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        if match is None or ep_size == 1 or ".adapter." in name:
            return name
        number = config.num_moe_experts // ep_size * parallel_state.get_expert_model_parallel_rank() + int(match[1])
        return f"{name[: match.start(1)]}{number}{name[match.end(1) :]}"

    return _megatron_local_name_to_global


_PARAM_MAPPING = "megatron.bridge.models.conversion.param_mapping"
_MODEL_BRIDGE = "megatron.bridge.models.conversion.model_bridge"
_KIMI_BRIDGE = "megatron.bridge.models.kimi.kimi_bridge"


def _export_reads_the_number_after_weight() -> bool:
    """Whether ``gather_from_ep_ranks`` takes the expert number from after ``.weight`` (0.3.x: ``int('')`` for
    ``local_experts.<N>``). Not where it asks ``extract_expert_number_from_param`` (``utils/common_utils.py``,
    0.4+) and that reads ``local_experts.<N>``; any other shape is drift."""
    mapping = importlib.import_module(_PARAM_MAPPING).MegatronParamMapping
    source = inspect.getsource(mapping.gather_from_ep_ranks)
    if "int(self.megatron_param.split(key)[-1])" in source:
        return True
    extract = getattr(importlib.import_module(_PARAM_MAPPING), "extract_expert_number_from_param", None)
    if "extract_expert_number_from_param(self.megatron_param)" in source and extract is not None:
        if extract("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == 3:
            return False
    raise UpstreamDrift(f"{package_of(_PARAM_MAPPING)}: MegatronParamMapping.gather_from_ep_ranks reads the expert "
                        "number in a way bridge_ext does not know (sequential-expert-export)")


def _local_experts_keep_local_numbers() -> bool:
    """Whether ``_megatron_local_name_to_global`` leaves ``local_experts.<N>`` local under EP (0.3.x, 0.4.x);
    0.6 renumbers it (``is_local_expert_param``)."""
    function = importlib.import_module(_MODEL_BRIDGE)._megatron_local_name_to_global
    return "local_experts" not in inspect.getsource(function)


# What KimiK2Bridge must map beyond grouped-GEMM experts: SequentialMLP experts, and the router's expert bias
# (the bridge turns moe_router_enable_expert_bias on; 0.4.2 maps the bias only in DeepSeekV3Bridge's own list).
_EXPERT_BIAS = ("decoder.layers.*.mlp.router.expert_bias", "model.layers.*.mlp.gate.e_score_correction_bias")
_KIMI_K2_NEEDS = ("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                  "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight", _EXPERT_BIAS[0])


def _kimi_k2_mapping_names() -> set[str] | None:
    """The Megatron names ``KimiK2Bridge`` maps; None without it (0.3: ``models/kimi/`` holds only a provider)."""
    if importlib.util.find_spec(_KIMI_BRIDGE) is None:
        return None
    bridge = importlib.import_module(_KIMI_BRIDGE).KimiK2Bridge
    try:  # its mapping_registry reads no instance state (0.4.2, 0.6.0); if one ever does, patch (adds only gaps)
        return {m.megatron_param for m in bridge.mapping_registry(bridge.__new__(bridge)).mappings}
    except AttributeError:
        return set()


def _kimi_k2_bridge_lacks_mappings() -> bool:
    names = _kimi_k2_mapping_names()
    return names is not None and not set(_KIMI_K2_NEEDS) <= names


def _with_kimi_k2_mappings(original: Callable) -> Callable:
    """``KimiK2Bridge.mapping_registry`` with the SequentialMLP expert names and the router's expert bias
    (``e_score_correction_bias``), each only where the bridge lacks it."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    with_experts = _with_sequential_expert_mappings(original)

    def mapping_registry(self) -> MegatronMappingRegistry:
        registry = with_experts(self)
        if _EXPERT_BIAS[0] in {m.megatron_param for m in registry.mappings}:
            return registry
        bias = AutoMapping(megatron_param=_EXPERT_BIAS[0], hf_param=_EXPERT_BIAS[1])
        return MegatronMappingRegistry(*registry.mappings, bias)

    return mapping_registry


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="deepseek-sequential-expert-mappings", area="conversion", scope="conversion",
        module="megatron.bridge.models.deepseek.deepseek_v3_bridge", attr="DeepSeekV3Bridge.mapping_registry",
        upstream="megatron/bridge/models/deepseek/common.py: expert mappings for grouped-GEMM names only",
        why="SequentialMLP experts (local_experts.<N>) would be skipped with a warning: neither loaded nor exported",
        when="where deepseek/common.py maps no local_experts names (megatron-bridge 0.3-0.4; 0.5 maps them)",
        needed=_deepseek_maps_no_sequential_experts,
        make=_with_sequential_expert_mappings,
    ),
    Patch(
        name="kimi-k2-bridge-mappings", area="conversion", scope="conversion",
        module=_KIMI_BRIDGE, attr="KimiK2Bridge.mapping_registry",
        upstream="megatron/bridge/models/kimi/kimi_bridge.py KimiK2Bridge.mapping_registry: deepseek/common.py's list",
        why="SequentialMLP experts and the router's expert bias (e_score_correction_bias) are unmapped: skipped with "
            "a warning, neither loaded nor exported",
        when="where Megatron Bridge's KimiK2Bridge (0.4+) lacks those mappings (0.4.2; 0.6 has them)",
        needed=_kimi_k2_bridge_lacks_mappings,
        make=_with_kimi_k2_mappings,
    ),
    Patch(
        name="sequential-expert-export", area="conversion", scope="conversion",
        module="megatron.bridge.models.conversion.param_mapping", attr="MegatronParamMapping.gather_from_ep_ranks",
        upstream="megatron/bridge/models/conversion/param_mapping.py MegatronParamMapping.gather_from_ep_ranks",
        why="reads the expert number after `.weight` (grouped-GEMM names): int('') for local_experts.<N>",
        when="where gather_from_ep_ranks reads the number after `.weight` (megatron-bridge 0.3)",
        needed=_export_reads_the_number_after_weight,
        snippets=("global_expert_number = int(self.megatron_param.split(key)[-1])",),
        make=_sequential_expert_export,
    ),
    Patch(
        name="sequential-expert-numbers", area="conversion", scope="conversion",
        module="megatron.bridge.models.conversion.model_bridge", attr="_megatron_local_name_to_global",
        upstream="megatron/bridge/models/conversion/model_bridge.py _megatron_local_name_to_global",
        why="globalizes grouped-GEMM expert numbers only: with --ep 2 rank 1's expert 0 would be HF expert 0",
        when="where _megatron_local_name_to_global leaves local_experts.<N> alone (megatron-bridge 0.3, 0.4)",
        needed=_local_experts_keep_local_numbers,
        snippets=('".mlp.experts.linear_fc" in param_name',),  # 0.3: `if ... and get_pg_size(..)`, 0.4: is_expert_param
        make=_global_sequential_expert_numbers,
    ),
)
