"""Building the Megatron side of a conversion (lazy imports: torch / Megatron load only when one runs)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bridge_ext.convert.parallel import init_model_parallel
from bridge_ext.errors import UserError
from bridge_ext.hf import apply_config_stated_fields, upstream_bridge_config

__all__ = ["ConfigSource", "bridge_for", "build_model", "model_param_names", "prepare_runtime"]


def _use_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def prepare_runtime() -> bool:
    """Import guards, CPU mode when no GPU is visible, and the conversion patches (SequentialMLP experts). True on CPU."""
    from bridge_ext import patches

    patches.apply("import")
    cpu = _use_cpu()
    if cpu:
        from bridge_ext import cpu as cpu_mode

        if not hasattr(cpu_mode, "enable_cpu_mode"):
            raise RuntimeError("bridge_ext.cpu.enable_cpu_mode is missing; CPU conversion needs it")
        cpu_mode.enable_cpu_mode()
    patches.apply("conversion")
    return cpu


def _configure_provider(provider: Any, *, cpu: bool, dtype: Any) -> None:
    """Settings for building the model to convert: official Megatron options, no patches.

    On CPU, :func:`bridge_ext.without_te.host_model.configure_host_model` (local layer spec, fusions off,
    SequentialMLP experts, allgather dispatcher); then the checkpoint's own dtype instead of CPU mode's fp32, so an
    import holds the weights once at their stored size. No initialization: weights are loaded right after.
    """
    import torch

    if cpu:  # a model in host memory (CPU mode, or a streamed conversion's skeleton on any machine)
        from bridge_ext.runtime import world_size
        from bridge_ext.without_te.host_model import configure_host_model

        configure_host_model(provider, world_size=world_size())
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    if hasattr(provider, "pipeline_dtype"):
        provider.pipeline_dtype = dtype
    if hasattr(provider, "autocast_dtype"):
        provider.autocast_dtype = dtype
    provider.perform_initialization = False
    provider.use_cpu_initialization = cpu


class ConfigSource:
    """What Megatron Bridge's conversion reads from an HF model, without weights.

    ``build_conversion_tasks`` needs ``state.source.get_all_keys()`` (``model_bridge.py:1185``) to decide which
    tensors exist; for an export those are the architecture's tensors, listed from a meta-device model. An
    import of a fused-expert checkpoint passes ``state``: its tensors under per-expert names.
    """

    def __init__(self, config: Any, keys: Iterable[str] = (), path: str | None = None, *, state: Any = None):
        import torch
        from megatron.bridge.models.hf_pretrained.state import StateDict

        self.config = config
        self.model_name_or_path = path
        self.trust_remote_code = False
        self.state = state if state is not None else StateDict({k: torch.empty(0, device="meta") for k in keys})


def bridge_for(config: Any, pretrained: Any | None = None, *, model_type: str | None = None) -> Any:
    """An ``AutoBridge`` for a transformers config (built by :func:`bridge_ext.hf.load_hf_config`).

    ``model_type``: the ``config.json``'s own; where Megatron Bridge has a bridge for it (``KimiK2Bridge`` for
    ``kimi_k2``, megatron-bridge >= 0.4) that bridge converts (:func:`bridge_ext.hf.upstream_bridge_config`).
    """
    from megatron.bridge import AutoBridge

    config = upstream_bridge_config(config, model_type=model_type)
    if pretrained is not None:
        pretrained.config = config
    try:
        AutoBridge._validate_config(config)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"Megatron Bridge cannot convert {config.architectures}: {first}") from None
    return AutoBridge(pretrained if pretrained is not None else config)


def build_model(bridge: Any, *, cpu: bool, dtype: Any, tp: int = 1, pp: int = 1, ep: int = 1) -> list[Any]:
    provider = bridge.to_megatron_provider(load_weights=False)
    hf = bridge.hf_pretrained  # a PreTrainedCausalLM, or a bare transformers config
    apply_config_stated_fields(provider, getattr(hf, "config", hf))
    _configure_provider(provider, cpu=cpu, dtype=dtype)
    _apply_layout(provider, tp=tp, pp=pp, ep=ep)
    provider.finalize()
    init_model_parallel(tp=tp, pp=pp, ep=ep, cpu=cpu)
    from bridge_ext import patches

    patches.register_hooks(provider)  # the applied rows' pre-wrap hooks (bridge_ext.patches)
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=cpu)


def _apply_layout(provider: Any, *, tp: int, pp: int, ep: int) -> None:
    """The conversion's ``--tp/--pp/--ep`` (checked by :func:`~bridge_ext.convert.parallel.check_layout`), set
    last: CPU settings (``configure_for_cpu``) are for one process.

    Expert tensor parallelism follows TP (Megatron's default when unset, ``TransformerConfig``), virtual
    pipelines and sequence parallelism are off: neither changes which weights a rank holds as a whole.
    """
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = tp
    provider.virtual_pipeline_model_parallel_size = None
    provider.sequence_parallel = False


def model_param_names(model: list[Any]) -> list[tuple[int, str]]:
    from megatron.bridge.models.conversion.model_bridge import persistent_buffers

    names = []
    for vp, module in enumerate(model):
        for name, _ in list(module.named_parameters()) + list(persistent_buffers(module)):
            while name.startswith("module."):  # Float16Module / DDP wrappers, as model_bridge._unwrap_name
                name = name[len("module.") :]
            if "_extra_state" not in name:
                names.append((vp, name))
    return names
