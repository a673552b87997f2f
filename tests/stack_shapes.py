"""How Megatron Bridge releases differ in the *shape* of one configuration (docs/stacks.md), for tests that
compare a resolved config with the shipped YAML on every stack."""

from __future__ import annotations

import yaml

from bridge_ext.generate import generating_stack
from bridge_ext.patches.optimizer_fields import RENAMED, RUN_TIME, WHERE_ABSENT

# Where Megatron Bridge releases differ in the *shape* of the same config (docs/stacks.md), each with why.
_EQUIVALENT_CLASSES = [  # the same config under another class name
    {"megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig",
     "megatron.bridge.training.config.DistributedDataParallelConfig"},  # 0.3.0: MB's deferred-finalize subclass
    {"megatron.bridge.models.mla_provider.MLAModelProvider",  # 0.3.1: generic providers; 0.3.0: per model
     "megatron.bridge.models.deepseek.deepseek_provider.DeepSeekV3ModelProvider"},
    {"megatron.bridge.models.gpt_provider.GPTModelProvider", "megatron.bridge.models.qwen.qwen_provider.Qwen3ModelProvider",
     "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider"},
]
_ONE_RELEASE_ONLY = {  # fields only one release's classes have
    "model.generation_config",  # 0.3.0 providers carry HF's generation config (inference only)
    "model.max_position_embeddings",  # 0.3.0 per-model providers
    "model.rope_scaling", "model.rope_scaling_factor", "model.rotary_scaling_factor",  # 0.3.1 GPTModelProvider
}
_SAME_MEANING = {  # different values, same model
    "model.mtp_loss_scaling_factor": {None, 0.1},  # unused: no multi-token-prediction layers
}


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def stack_differences(shipped: dict, built: dict, *, release_shapes: bool = True) -> list[str]:
    """Field differences between two resolved configs (not counting the release shapes listed above, unless
    ``release_shapes`` is False)."""
    a, b = _flatten(shipped), _flatten(built)
    if release_shapes:  # optimizer fields under megatron-core 0.19's names (bridge_ext.patches.optimizer_fields)
        a, b = _canonical_optimizer_names(a), _canonical_optimizer_names(b)
    problems = []
    for key in sorted(set(a) | set(b)):
        if release_shapes and any(key == f or key.startswith(f + ".") for f in _ONE_RELEASE_ONLY):
            continue
        if release_shapes and (key not in a or key not in b) and _runs_where_absent(key, a.get(key, b.get(key))):
            continue  # a field one release lacks, set to what that release always runs
        if key not in a or key not in b:
            problems.append(f"{key} only in {'shipped' if key in a else 'built'}")
        elif a[key] != b[key]:
            if release_shapes and key.endswith("_target_") and any({a[key], b[key]} <= g for g in _EQUIVALENT_CLASSES):
                continue
            if release_shapes and key in _SAME_MEANING and {a[key], b[key]} <= _SAME_MEANING[key]:
                continue
            problems.append(f"{key}: shipped {a[key]!r}, built {b[key]!r}")
    return problems


_OLD_NAMES = {f"optimizer.{old}": f"optimizer.{new}" for new, olds in RENAMED.items() for old in olds}


def _canonical_optimizer_names(flat: dict) -> dict:
    return {_OLD_NAMES.get(key, key): value for key, value in flat.items()}


def _runs_where_absent(key: str, value) -> bool:
    section, _, name = key.partition(".")
    fixed = WHERE_ABSENT.get(name, (None, ""))[0] if section == "optimizer" else None
    return name in WHERE_ABSENT and section == "optimizer" and (fixed == RUN_TIME or fixed == value)


def config_differences(shipped_text: str, built_text: str) -> list[str]:
    """Every differing field; on a stack other than the one that resolved the shipped YAML (its header
    names it), not counting the release shapes above."""
    same_stack = generating_stack() in shipped_text.split("\n", 3)[2]
    return stack_differences(yaml.safe_load(shipped_text), yaml.safe_load(built_text), release_shapes=not same_stack)
