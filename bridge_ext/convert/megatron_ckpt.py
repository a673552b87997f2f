"""Megatron checkpoints: which iteration, which HF config it came from, its dtype, loading its weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge_ext import checkpoints
from bridge_ext.errors import UserError
from bridge_ext.hf.directory import HF_SOURCE_DIR
from recipes.architecture import Architecture

__all__ = ["cause_line", "checkpoint_param_dtype", "find_iteration", "hf_source_for_checkpoint",
           "load_model_weights", "provider_fields", "tokenizer_dirs"]


# Which iteration to export: the one a rerun of the training command resumes from (bridge_ext.checkpoints,
# shared with training), or a complete one chosen with --iteration.
find_iteration = checkpoints.find_iteration


def _read_run_config(iter_dir: Path) -> dict[str, Any]:
    file = iter_dir / "run_config.yaml"
    if not file.is_file():
        return {}
    try:
        from bridge_ext.runtime import read_yaml

        return read_yaml(file) or {}
    except Exception:  # a run config we cannot parse only loses us a hint
        return {}


def hf_source_for_checkpoint(ckpt: Path, iter_dir: Path, explicit: Path | None) -> Path:
    """Where the HF config (and tokenizer files) of a Megatron checkpoint are.

    In order: ``--hf-config``; the ``hf_source/`` kept by ``import`` (checkpoint root, or the root above an
    iteration directory); the ``model.hf_model_id`` a Megatron Bridge run recorded in ``run_config.yaml``
    when it is a local directory; the shipped recipe config whose sizes match the run's model.
    """
    if explicit is not None:
        if not (explicit / "config.json").is_file():
            raise UserError(f"--hf-config {explicit} has no config.json")
        return explicit
    for root in (ckpt, iter_dir, iter_dir.parent):
        if (root / HF_SOURCE_DIR / "config.json").is_file():
            return root / HF_SOURCE_DIR
    model = _read_run_config(iter_dir).get("model") or {}
    model = model if isinstance(model, dict) else {}
    hf_id = model.get("hf_model_id")
    if hf_id and (Path(hf_id) / "config.json").is_file():
        return Path(hf_id)
    shipped = _matching_shipped_config(model)
    if shipped is not None:
        return shipped
    hint = f" (its run config names {hf_id!r}, which is not a local directory)" if hf_id else ""
    raise UserError(
        f"{ckpt} does not say which Hugging Face config it was built from{hint}; pass --hf-config DIR "
        "(a directory with the model's config.json)"
    )


def provider_fields(architecture: Architecture) -> dict[str, Any]:
    """The Megatron provider fields (as a run's ``run_config.yaml`` records its ``model`` section) that a model's
    architecture fixes: Megatron Bridge's bridges set them from the HF config (``CONFIG_MAPPING`` of
    ``model_bridge.py`` / each family's ``provider_bridge``), here read from the recipes' parsed
    :class:`~recipes.architecture.Architecture`, so a family's own key names are interpreted in one place."""
    a = architecture
    fields: dict[str, Any] = {
        "hidden_size": a.hidden_size, "num_layers": a.num_layers, "num_attention_heads": a.num_attention_heads,
        "vocab_size": a.vocab_size, "ffn_hidden_size": a.ffn_hidden_size, "num_query_groups": a.num_kv_heads,
        "num_moe_experts": a.moe.experts if a.moe else None, "multi_latent_attention": a.mla is not None,
    }  # fmt: skip
    if a.moe:
        fields.update(moe_ffn_hidden_size=a.moe.ffn_hidden_size, moe_router_topk=a.moe.top_k)
    if a.mla:
        fields.update(kv_lora_rank=a.mla.kv_lora_rank, q_lora_rank=a.mla.q_lora_rank,
                      qk_pos_emb_head_dim=a.mla.qk_rope_head_dim, v_head_dim=a.mla.v_head_dim)
    else:  # MLA's per-head sizes are the fields above; kv_channels is GQA's head_dim
        fields["kv_channels"] = a.head_dim
    return fields


def _matching_shipped_config(model: dict[str, Any]) -> Path | None:
    """The one shipped ``recipes/hf_configs/<name>`` whose sizes equal the run's model section, if any.

    Recipes build their models from these configs (``bridge_ext/build.py``) without recording the directory
    (``model.hf_model_id`` is null), so a run is recognized by its architecture numbers
    (:func:`provider_fields` of each model spec's :class:`~recipes.architecture.Architecture`). A run whose
    model was overridden matches none and must name its config with ``--hf-config``.
    """
    from recipes.models import MODELS, RELEASES

    if not model.get("hidden_size") or not model.get("num_layers"):
        return None
    matches = []
    for spec in (*MODELS.values(), *RELEASES.values()):
        expected = provider_fields(spec.architecture)
        if all(model.get(field, False if field == "multi_latent_attention" else None) == value
               for field, value in expected.items()) and all(  # fmt: skip
                model.get(field, value) == value for field, value in _rope_fields(spec.hf_config).items()):
            matches.append(spec.config_dir)
    return matches[0] if len(set(matches)) == 1 else None


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """What tells a release from its base model (same sizes, other RoPE: Qwen3-2507's theta, Kimi K2 0905 /
    Thinking's YaRN factor), as provider fields; compared only where the run's config records them."""
    fields = {"rotary_base": raw["rope_theta"]} if raw.get("rope_theta") is not None else {}
    rope = raw.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("type", rope.get("rope_type")) == "yarn":
        fields["rotary_scaling_factor"] = rope.get("factor")
    return fields


def checkpoint_param_dtype(iter_dir: Path) -> Any:
    """The dtype the checkpoint stores model weights in (from the torch DCP metadata), or None."""
    import torch

    from bridge_ext.checkpoints.pickles import load_metadata

    metadata = load_metadata(iter_dir)  # only allowed classes; a damaged file is one line naming it
    counts: dict[Any, int] = {}
    for key, meta in metadata.state_dict_metadata.items():
        props = getattr(meta, "properties", None)
        if props is None or not hasattr(meta, "size") or "optim" in key:
            continue
        if "embedding" in key or "linear" in key:
            counts[props.dtype] = counts.get(props.dtype, 0) + 1
    if not counts:
        raise UserError(f"{iter_dir} holds no model weights (is it a Megatron checkpoint of a GPT model?)")
    dtype = max(counts, key=counts.get)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def load_model_weights(iter_dir: Path, model: list[Any]) -> None:
    """Load a torch_dist checkpoint's model weights (optimizer state is never read) without a second copy.

    Megatron Bridge's ``_load_model_weights_from_checkpoint`` (``training/checkpointing.py:1232-1304``) is
    followed, with one change: the gated fc1 weights are saved as two halves through a factory whose merge
    (``megatron/core/transformer/mlp.py:335-338``, ``torch.cat``) builds a new tensor for every layer and
    expert, all alive next to the model until the final copy: +0.4x of the checkpoint for a dense Qwen3, up
    to +0.65x for MoE models. torch DCP reads the halves in place into views of the parameter, so when both
    halves are such views the merge returns the parameter itself; otherwise the original merge runs.
    """
    from megatron.bridge.training.checkpointing import _generate_model_state_dict
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.utils import unwrap_model

    directory = str(iter_dir)
    common = dist_checkpointing.load_common_state_dict(directory)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    modules = unwrap_model(model)
    sharded = _generate_model_state_dict(modules, dict(metadata=metadata))
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensorFactory) and getattr(value.merge_fn, "__name__", "") == "sh_ten_merge_fn":
            value.merge_fn = _in_place_merge(value.data, value.merge_fn)
    loaded = dist_checkpointing.load(sharded, directory, get_default_load_sharded_strategy(directory))
    for key, module in zip(["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))], modules):
        state = {k: v for k, v in loaded.get(key, {}).items() if "_extra_state" not in k}
        expected = {n for n in module.state_dict() if "_extra_state" not in n}
        missing = sorted(expected - set(state))
        if missing:
            raise UserError(f"{iter_dir} lacks weights for {missing[0]} ({len(missing)} in all)")
        module.load_state_dict(state, strict=False)


def _in_place_merge(param: Any, merge: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``merge``, except when the loaded parts are consecutive views covering ``param``: then ``param``."""

    def end(t: Any) -> int:
        return t.data_ptr() + t.numel() * t.element_size()

    def merged(parts: Any) -> Any:
        parts = list(parts)
        storage = param.untyped_storage().data_ptr()
        contiguous = all(p.untyped_storage().data_ptr() == storage for p in parts) and all(
            end(a) == b.data_ptr() for a, b in zip(parts, parts[1:])
        )
        if contiguous and parts[0].data_ptr() == param.data_ptr() and end(parts[-1]) == end(param):
            return param
        return merge(parts)

    return merged


def tokenizer_dirs(iter_dir: Path) -> list[Path]:
    """Where a run keeps HF tokenizer files: Megatron Bridge's saved assets, then the run's tokenizer_model."""
    found = [iter_dir / "tokenizer"] if (iter_dir / "tokenizer").is_dir() else []
    tokenizer = _read_run_config(iter_dir).get("tokenizer") or {}
    model = tokenizer.get("tokenizer_model") if isinstance(tokenizer, dict) else None
    if tokenizer.get("tokenizer_type") == "HuggingFaceTokenizer" and model and Path(str(model)).is_dir():
        found.append(Path(str(model)))
    return found


def cause_line(exc: BaseException) -> str:
    """The informative line of a (possibly multi-line, multi-rank) checkpoint loading error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for needle in ("mismatch", "Missing key", "missing", "Unexpected key", "not found"):
        for line in reversed(lines):
            if needle in line:
                return line[:300]
    return (lines[0] if lines else type(exc).__name__)[:300]
