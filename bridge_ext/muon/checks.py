"""What the installed stack gets wrong about Muon and QK-clip: probes of upstream code, and the launch checks.

Launch checks (:func:`launch_problems`, called by ``bridge_ext.build.launch_problems`` with the layout before a
launch or a dry run; one line each, with the fix; tests/test_upstream_muon_bugs.py):

* ``model.qk_clip`` with the query/key weights under the distributed optimizer with an fp32 master copy
  (AdamW + ``use_distributed_optimizer`` in bf16/fp16; Megatron-LM PR 7382's other half): ``clip_qk`` views
  the master as the whole matrix, which the distributed optimizer keeps as a flat shard (a crash at the
  first clip). Refused where the installed ``clip_qk`` fails on such a shard (probe). Muon keeps these
  matrices whole (layer-wise or not): unaffected.
* ``dist_muon``/``muon`` with ``use_distributed_optimizer`` (Megatron-LM issue 2164): where the installed
  ``optimizer/muon.py`` refuses it ("muon with dist optimizer is not supported", megatron-core 0.16/0.17), the
  error comes after the model is built and reads as if distributed Muon did not exist; ``dist_muon`` is the
  layer-wise distributed Muon already. Decided by that source text.
* ``checkpoint.ckpt_format=torch`` with layer-wise Muon (Megatron-Bridge issue 2307): Megatron Bridge's
  ``save_checkpoint`` writes each data-parallel rank's layer-wise optimizer state to
  ``<save>/layer_wise_optimizer_<dp rank>.pt``, in the checkpoint root: every save overwrites the previous
  iteration's, which then resumes with another iteration's optimizer state. Decided by where the installed
  ``save_checkpoint`` joins that file name (every release read: megatron-bridge 0.3.0-0.6.2).

Probe (the condition of the ``qk-clip-nonpositive-logit-*`` patches, ``bridge_ext.patches.transformer``):
:func:`nonpositive_logit_nans` runs the installed ``clip_qk`` on a two-head stub whose second head's max logit
is negative (every release read, megatron-core 0.16.0-0.19.2, writes NaN into it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from bridge_ext.stack import UpstreamDrift, module_source, package_of
from recipes.optimizers import is_muon

__all__ = ["launch_problems", "layer_wise_file_in_root", "nonpositive_logit_nans", "sharded_master_fails"]

_MLA = "megatron.core.transformer.multi_latent_attention"
_GQA = "megatron.core.transformer.attention"
_TAU = 100.0


def _stub(cls: type, **attrs: Any) -> Any:
    """An instance of an attention class without its ``__init__`` (no process groups, no layers): ``attrs``
    are all that ``clip_qk`` reads."""
    import torch

    stub = cls.__new__(cls)
    torch.nn.Module.__init__(stub)
    for name, value in attrs.items():
        object.__setattr__(stub, name, value)
    return stub


def _config(**extra: Any) -> SimpleNamespace:
    return SimpleNamespace(qk_clip=True, qk_clip_threshold=_TAU, qk_clip_alpha=0.5, **extra)


def _mla_probe(*, master: bool = False) -> tuple[Any, Callable[[Any], list[Any]]]:
    """Two MLA heads (q_nope 2, q_rope 1, v 2 rows each), max logits (4 tau, -1); returns (stub, head-1 rows)."""
    import torch

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    q, kv = torch.ones(2 * 3, 3), torch.ones(2 * 4, 3)
    if master:  # the distributed optimizer's fp32 master: this rank's flat slice of the matrix
        q.main_param = q.view(-1)[: q.numel() // 2].clone()
        q.main_param_sharded = True
    stub = _stub(MLASelfAttention, config=_config(q_lora_rank=None, qk_head_dim=2, qk_pos_emb_head_dim=1,
                                                  v_head_dim=2),
                 core_attention=SimpleNamespace(current_max_attn_logits=torch.tensor([4 * _TAU, -1.0])),
                 num_attention_heads_per_partition=2, cache_mla_latents=False,
                 linear_q_proj=SimpleNamespace(weight=q), linear_kv_up_proj=SimpleNamespace(weight=kv))
    return stub, lambda s: [s.linear_q_proj.weight.view(2, 3, -1), s.linear_kv_up_proj.weight.view(2, 4, -1)]


def _gqa_probe() -> tuple[Any, Callable[[Any], list[Any]]]:
    """Two GQA heads in two query groups (head dim 2), max logits (4 tau, -1)."""
    import torch

    from megatron.core.transformer.attention import SelfAttention

    # the whole model's sizes too (one process: equal to the rank's), which qk-clip-gqa-tp-shapes' rows read
    stub = _stub(SelfAttention, config=_config(num_query_groups=2, num_attention_heads=2, kv_channels=2),
                 core_attention=SimpleNamespace(current_max_attn_logits=torch.tensor([4 * _TAU, -1.0])),
                 num_attention_heads_per_partition=2, num_query_groups_per_partition=2,
                 query_projection_size=4, kv_projection_size=4,
                 linear_qkv=SimpleNamespace(weight=torch.ones(12, 3)))
    return stub, lambda s: [s.linear_qkv.weight.view(2, 6, -1)]


_PROBES = {_MLA: _mla_probe, _GQA: _gqa_probe}


def _upstream(function: Any) -> Any:
    return getattr(function, "_bridge_ext_original", function)


def nonpositive_logit_nans(module: str, cls: str, *, clip_qk: Callable[[Any], Any] | None = None) -> bool:
    """Whether the installed ``cls.clip_qk`` (upstream's, patched or not; or ``clip_qk``) harms a head whose max
    logit is negative: NaN in, or any change to, its rows, while the head above tau is scaled (the control)."""
    import importlib

    import torch

    clip_qk = clip_qk or _upstream(getattr(importlib.import_module(module), cls).clip_qk)
    stub, views = _PROBES[module]()
    try:
        with torch.no_grad():
            clip_qk(stub)
    except Exception as exc:  # noqa: BLE001 - any failure means the probe no longer fits upstream
        raise UpstreamDrift(f"{package_of(module)}: {cls}.clip_qk no longer runs on bridge_ext's two-head probe "
                            f"({type(exc).__name__}: {exc}); bridge_ext.muon.checks needs updating") from None
    heads = views(stub)
    if all(torch.equal(w[0], torch.ones_like(w[0])) for w in heads):
        raise UpstreamDrift(f"{package_of(module)}: {cls}.clip_qk left a head at 4 x qk_clip_threshold "
                            "unscaled on bridge_ext's probe; bridge_ext.muon.checks needs updating")
    return not all(torch.equal(w[1], torch.ones_like(w[1])) for w in heads)


def sharded_master_fails() -> bool:
    """Whether the installed MLA ``clip_qk`` fails on a weight whose fp32 master is a flat shard (the
    distributed optimizer's ``main_param``, ``main_param_sharded``)."""
    import torch

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    stub, _ = _mla_probe(master=True)
    try:
        with torch.no_grad():
            _upstream(MLASelfAttention.clip_qk)(stub)
    except RuntimeError:  # "shape '[2, 3, -1]' is invalid for input of size 9"
        return True
    return False


_MUON = "megatron.core.optimizer.muon"
_CKPT = "megatron.bridge.training.checkpointing"
_JOIN = re.compile(r"optim_checkpoint_name\s*=\s*os\.path\.join\((?P<base>[^,]+),\s*f[\"']layer_wise_optimizer_")


def layer_wise_file_in_root() -> bool:
    """Whether the installed ``save_checkpoint`` writes ``layer_wise_optimizer_<rank>.pt`` outside the iteration
    directory (``save_dir`` or the iteration directory's parent) rather than into it (``checkpoint_name``)."""
    bases = {match["base"].strip() for match in _JOIN.finditer(module_source(_CKPT))}
    if not bases:
        if "layer_wise_optimizer_" in module_source(_CKPT):
            raise UpstreamDrift(f"{package_of(_CKPT)}: save_checkpoint names layer_wise_optimizer_ files in a way "
                                "bridge_ext.muon.checks does not know; it needs updating")
        return False  # no such file written
    unknown = bases - {"save_dir", "os.path.dirname(checkpoint_name)", "checkpoint_name"}
    if unknown:
        raise UpstreamDrift(f"{package_of(_CKPT)}: save_checkpoint joins layer_wise_optimizer_ files onto "
                            f"{sorted(unknown)}; bridge_ext.muon.checks needs updating")
    return bool(bases & {"save_dir", "os.path.dirname(checkpoint_name)"})


def _layer_wise(opt: Any) -> bool:
    return opt.optimizer == "dist_muon" or (opt.optimizer == "muon"
                                            and bool(getattr(opt, "use_layer_wise_distributed_optimizer", False)))


def launch_problems(cfg: Any) -> list[str]:
    """What the installed stack would get wrong, or fail on confusingly, with ``cfg``: one line each, with
    the fix (empty when nothing)."""
    opt, model = cfg.optimizer, cfg.model
    distributed = bool(opt.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer)
    out = []
    master = bool(getattr(opt, "bf16", False) or getattr(opt, "fp16", False))
    if (getattr(model, "qk_clip", False) and distributed and master
            and not is_muon(opt.optimizer) and sharded_master_fails()):
        out.append(f"model.qk_clip with optimizer.optimizer={opt.optimizer} and the distributed optimizer: "
                   f"{package_of(_MLA)}'s clip_qk cannot scale the sharded fp32 master weights (Megatron-LM PR "
                   "7382); use a Muon optimizer (MuonClip), or set optimizer.use_distributed_optimizer=false and "
                   "ddp.use_distributed_optimizer=false")
    if (distributed and is_muon(opt.optimizer)
            and "muon with dist optimizer is not supported" in module_source(_MUON)):
        out.append(f"optimizer.optimizer={opt.optimizer} with use_distributed_optimizer: {package_of(_MUON)} "
                   "runs Muon only without the distributed optimizer (dist_muon is the layer-wise distributed "
                   "Muon already; Megatron-LM issue 2164); set optimizer.use_distributed_optimizer=false and "
                   "ddp.use_distributed_optimizer=false")
    if (is_muon(opt.optimizer) and getattr(model, "num_moe_experts", None)
            and getattr(model, "moe_use_legacy_grouped_gemm", False)):
        out.append("model.moe_use_legacy_grouped_gemm=true with Muon: the legacy GroupedMLP holds a rank's experts "
                   "as one matrix, which Muon orthogonalizes as one (experts mixed, how many depends on EP); set "
                   "model.moe_use_legacy_grouped_gemm=false")
    if cfg.checkpoint.ckpt_format == "torch" and _layer_wise(opt) and layer_wise_file_in_root():
        out.append(f"checkpoint.ckpt_format=torch with layer-wise Muon ({opt.optimizer}): {package_of(_CKPT)} "
                   "writes its optimizer state to <checkpoint.save>/layer_wise_optimizer_<rank>.pt, which every "
                   "save overwrites (Megatron-Bridge issue 2307); use checkpoint.ckpt_format=torch_dist")
    return out
