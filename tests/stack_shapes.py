"""How Megatron Bridge releases differ in the *shape* of one configuration (docs/stacks.md), for tests that
compare a resolved config with the shipped YAML on every stack."""

from __future__ import annotations

import dataclasses
import importlib

import yaml

from bridge_ext.shipped_files import generating_stack
from bridge_ext.upstream_api import RENAMED, RUN_TIME, WHERE_ABSENT

# Where Megatron Bridge releases differ in the *shape* of the same config (docs/stacks.md), each with why.
_EQUIVALENT_CLASSES = [  # the same config under another class name
    {"megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig",
     "megatron.bridge.training.config.DistributedDataParallelConfig"},  # 0.3.0: MB's deferred-finalize subclass
    {"megatron.bridge.models.mla_provider.MLAModelProvider",  # 0.3.1: generic providers; 0.3.0: per model
     "megatron.bridge.models.deepseek.deepseek_provider.DeepSeekV3ModelProvider"},
    {"megatron.bridge.models.gpt_provider.GPTModelProvider", "megatron.bridge.models.qwen.qwen_provider.Qwen3ModelProvider",
     "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider"},
    {"megatron.bridge.training.config.RNGConfig",  # 0.4 moved it to megatron-core's megatron.training
     "megatron.training.config.common_config.RNGConfig"},
]
_ONE_RELEASE_ONLY = {  # fields only one release's classes have
    "model.generation_config",  # 0.3.0 providers carry HF's generation config (inference only)
    "model.max_position_embeddings",  # 0.3.0 per-model providers
    "model.rope_scaling", "model.rope_scaling_factor", "model.rotary_scaling_factor",  # 0.3.1 GPTModelProvider
}
# Fields a later release removed -> the value the shipped YAML must hold: the behaviour that release always runs.
# (A field only the *built* release has is a release shape when it is at its class's default: nothing asked for it,
# _new_field_at_default.)
_REMOVED = {
    "model.async_tensor_model_parallel_allreduce": True,  # read by nothing in megatron-core 0.16; 0.17 dropped it
    "model.moe_extended_tp": False,  # read by nothing in 0.16 (expert_tensor_parallel_size replaced it); 0.17 too
    "model.moe_use_legacy_grouped_gemm": False,  # 0.17 dropped the legacy GroupedMLP: the non-legacy experts always
    "ddp.preserve_fp32_weights": True,  # Megatron-FSDP's buffer option (no recipe uses Megatron-FSDP); 0.17 dropped it
    "tokenizer.legacy_tokenizer": False,  # megatron-bridge 0.4 builds only the non-legacy tokenizers
    "tokenizer.tiktoken_special_tokens": None,  # no recipe uses a tiktoken tokenizer; megatron-bridge 0.5 dropped it
}
# Fields only the built release has, not at their class default -> the value they must hold (derived upstream).
_NEW = {
    # megatron-core 0.17 CheckpointConfig.__post_init__ sets "mcore" when async_save is off (off in every recipe)
    "checkpoint.async_strategy": "mcore",
    # megatron-bridge 0.5 TokenizerConfig.__post_init__ sets False: Megatron Bridge pads the vocabulary itself
    "tokenizer.pad_vocab_size": False,
}
_RENAMED = {"dist.lazy_init": "dist.lazy_mpu_init",  # megatron-bridge 0.4: lazy_init is a property of the new name
            # megatron-bridge 0.6's GPTDatasetConfig writes its own field seq_length (finalize() copies it into
            # megatron-core's sequence_length, which 0.3-0.5 write)
            "dataset.sequence_length": "dataset.seq_length"}
# Fields a later release moved -> their new home; the old field stays (deprecated) and wins when it is set
# (megatron-bridge 0.4 ConfigContainer.validate copies train.<f> into validation.<f> when not None).
_MOVED = {f"train.{name}": f"validation.{name}" for name in ("eval_interval", "eval_iters", "skip_train")}
_SAME_MEANING = {  # different values, same run
    "model.mtp_loss_scaling_factor": {None, 0.1},  # unused: no multi-token-prediction layers
    # SMs the HybridEP dispatch kernels use (megatron-core 0.16 default 16, 0.17+ None = DeepEP's own): speed only,
    # the same tokens reach the same experts
    "model.moe_hybridep_num_sms": {16, None},
    # likewise DeepEP's (megatron-core 0.16 default 20; 0.19 None: deprecated for moe_flex_dispatcher_num_sms, the
    # backend's own count)
    "model.moe_deepep_num_sms": {20, None},
    # log verbosity only: megatron-bridge 0.6's None means MEGATRON_LOGGING_LEVEL, else INFO (20, 0.3's default)
    "logger.logging_level": {20, None},
    # data-loader worker processes (megatron-bridge 0.4's DataloaderConfig defaults 2 / True, 0.3's 8 / False):
    # speed and host memory only, the batches and their order are the sampler's
    "dataset.num_workers": {8, 2}, "dataset.persistent_workers": {False, True},
    "dist.high_priority_stream_groups": {None, ()},  # no high-priority stream groups either way
    # written only when profiling.record_memory_history is on (compared as well: off in every recipe)
    "profiling.memory_snapshot_path": {"snapshot.pickle", "/nemo_run/snapshot.pickle"},
    # read only with CUDA graphs (cuda_graph_impl 'none', compared as well: none in any recipe); megatron-core
    # 0.18 changed their defaults
    "model.cuda_graph_scope": {"full", None}, "model.cuda_graph_use_single_mempool": {False, True},
}


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def stack_differences(shipped: dict, built: dict, *, release_shapes: bool = True) -> list[str]:
    """Field differences between two resolved configs (not counting the release shapes listed above, unless
    ``release_shapes`` is False)."""
    a, b = _flatten(shipped), _flatten(built)
    if release_shapes:  # renamed fields under their new names (optimizer: bridge_ext.upstream_api)
        a, b = _moved_home(_canonical_names(a)), _moved_home(_canonical_names(b))
    problems = []
    for key in sorted(set(a) | set(b)):
        if release_shapes and any(key == f or key.startswith(f + ".") for f in _ONE_RELEASE_ONLY):
            continue
        if release_shapes and (key not in a or key not in b) and _runs_where_absent(key, a.get(key, b.get(key))):
            continue  # a field one release lacks, set to what that release always runs
        if release_shapes and key not in b and key in _REMOVED and a[key] == _REMOVED[key]:
            continue  # a field the built release removed, at the behaviour it always runs
        if release_shapes and key not in a and (_new_field_at_default(key, b) or key in _NEW and b[key] == _NEW[key]):
            continue  # a field the shipped release lacks, left at the built release's default
        if release_shapes and key not in a and key.endswith("._name_"):
            continue  # 0.4+'s enum representer also writes the member's name beside its value (`_args_`, compared)
        section = key.removesuffix("_target_")
        if release_shapes and key.endswith("._target_") and not any(k.startswith(section) for k in a):
            continue  # a config section the shipped release lacks (its fields are compared one by one)
        if key not in a or key not in b:
            problems.append(f"{key} only in {'shipped' if key in a else 'built'}")
        elif a[key] != b[key]:
            if release_shapes and key.endswith("_target_") and any({a[key], b[key]} <= g for g in _EQUIVALENT_CLASSES):
                continue
            if release_shapes and key in _SAME_MEANING and {_frozen(a[key]), _frozen(b[key])} <= _SAME_MEANING[key]:
                continue
            problems.append(f"{key}: shipped {a[key]!r}, built {b[key]!r}")
    return problems


_OLD_NAMES = {**{f"optimizer.{old}": f"optimizer.{new}" for new, olds in RENAMED.items() for old in olds}, **_RENAMED}


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def _moved_home(flat: dict) -> dict:
    """A moved field under its old name with the value the release runs (the old one's if set, else the new
    home's), the new home dropped."""
    out = dict(flat)
    for old, new in _MOVED.items():
        if new in out:
            home = out.pop(new)
            out[old] = home if out.get(old) is None else out[old]
    return out


def _config_class(target) -> type | None:
    """The dataclass a YAML node's ``_target_`` names (None for anything else: a dtype, an enum, a function)."""
    module, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def _new_field_at_default(key: str, flat: dict) -> bool:
    """Whether ``key`` is a field of the class its section names (``_target_``, the installed release's) and holds
    that class's default, as the YAML representers write it."""
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):  # the innermost config class above the field
        cls = _config_class(flat.get(".".join(parts[:depth] + ["_target_"])))
        if cls is not None:
            break
    else:
        return False
    field = next((f for f in dataclasses.fields(cls) if f.name == parts[depth]), None)
    if field is None or (field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING):
        return False
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    from megatron.bridge.utils.yaml_utils import safe_yaml_representers  # 0.3: defined here; 0.6: re-exported

    with safe_yaml_representers():
        written = _flatten(yaml.safe_load(yaml.safe_dump({"v": default})), "")
    return written.get(".".join(["v", *parts[depth + 1:]]), object()) == flat[key]


def _canonical_names(flat: dict) -> dict:
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
