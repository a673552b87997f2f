"""QK-clip: known upstream bugs and their patches (tests/test_upstream_muon_bugs.py; the others: muon_bugs).

Patches (scope ``stack``, every run, GPUs too):

* ``qk-clip-nonpositive-logit-mla`` / ``-gqa`` (Megatron-LM PR 7382): megatron-core's ``clip_qk``
  (``transformer/multi_latent_attention.py`` ``MLASelfAttention.clip_qk``; ``transformer/attention.py``
  ``SelfAttention.clip_qk``) scales each head by ``eta = clamp(tau / S_max, max=1)``, q by ``eta ** alpha``
  and k by ``eta ** (1 - alpha)``, once any head of the layer is above tau. A head whose max logit S_max is
  negative gets ``eta < 0``: ``eta ** alpha`` is NaN in its q and k weights (and their fp32 master), then in
  the whole run. MuonClip (Kimi K2, arXiv 2507.20534, Algorithm 1) scales a head by
  ``gamma = min(1, tau / S_max)`` only where S_max > tau. The patch floors the maxima at tau before
  upstream's ``clip_qk`` runs: every head at or under tau then gets ``eta = tau / tau = 1`` exactly (weights
  bit for bit untouched, as upstream leaves a head in (0, tau]); heads above tau are scaled as before.
  Applies where the installed ``clip_qk``, run on a two-head probe whose second head's max logit is
  negative, writes NaN into that head or changes it (every release read: megatron-core 0.16.0-0.19.2).

Refusal (one line, :func:`launch_problems`, checked with the layout before a launch or a dry run):

* ``model.qk_clip`` with the query/key weights under the distributed optimizer with an fp32 master copy
  (AdamW + ``use_distributed_optimizer`` in bf16/fp16; Megatron-LM PR 7382's other half): ``clip_qk`` views
  the master as the whole matrix, which the distributed optimizer keeps as a flat shard (a crash at the
  first clip). Refused where the installed ``clip_qk`` fails on such a shard (probe). Muon keeps these
  matrices whole (layer-wise or not): unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from bridge_ext.patches.core import Patch
from bridge_ext.stack import UpstreamDrift, package_of

__all__ = ["PATCHES", "launch_problems", "nonpositive_logit_nans", "sharded_master_fails"]

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

    stub = _stub(SelfAttention, config=_config(),
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
                            f"({type(exc).__name__}: {exc}); bridge_ext.patches.qk_clip needs updating") from None
    heads = views(stub)
    if all(torch.equal(w[0], torch.ones_like(w[0])) for w in heads):
        raise UpstreamDrift(f"{package_of(module)}: {cls}.clip_qk left a head at 4 x qk_clip_threshold "
                            "unscaled on bridge_ext's probe; bridge_ext.patches.qk_clip needs updating")
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


def _floored(clip_qk: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(clip_qk)
    def clip_qk_floored(self: Any) -> Any:
        import torch

        core = self.core_attention
        if core.current_max_attn_logits is not None:
            # S_max <= tau leaves a head as it is (eta = 1); flooring at tau keeps S_max <= 0 from eta < 0
            core.current_max_attn_logits = torch.clamp(core.current_max_attn_logits,
                                                       min=float(self.config.qk_clip_threshold))
        return clip_qk(self)

    clip_qk_floored._bridge_ext_original = clip_qk  # type: ignore[attr-defined]
    return clip_qk_floored


def _clip_patch(kind: str, module: str, cls: str, path: str) -> Patch:
    return Patch(
        name=f"qk-clip-nonpositive-logit-{kind}", area="optimizer", scope="stack", module=module,
        attr=f"{cls}.clip_qk",
        upstream=f"megatron/core/transformer/{path} {cls}.clip_qk (Megatron-LM PR 7382)",
        why="a head whose max attention logit is < 0 gets eta = tau / S_max < 0 and eta ** alpha = NaN in its "
            "query and key weights; the maxima are floored at tau first (eta = 1: the head untouched, as "
            "MuonClip's gamma = min(1, tau / S_max))",
        when=f"{cls}.clip_qk, on a two-head probe with one max logit negative, writes NaN into that head",
        needed=lambda: nonpositive_logit_nans(module, cls),
        snippets=("self.core_attention.current_max_attn_logits", "self.config.qk_clip_threshold"),
        accepts=lambda function: callable(function) and not hasattr(function, "_bridge_ext_original"),
        make=_floored,
    )


PATCHES: tuple[Patch, ...] = (
    _clip_patch("mla", _MLA, "MLASelfAttention", "multi_latent_attention.py"),
    _clip_patch("gqa", _GQA, "SelfAttention", "attention.py"),
)


def launch_problems(cfg: Any) -> list[str]:
    """What the installed stack would get wrong, or fail on confusingly, with ``cfg``: one line each, with
    the fix (empty when nothing)."""
    opt, model = cfg.optimizer, cfg.model
    distributed = bool(opt.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer)
    out = []
    master = bool(getattr(opt, "bf16", False) or getattr(opt, "fp16", False))
    if (getattr(model, "qk_clip", False) and distributed and master
            and opt.optimizer not in ("muon", "dist_muon") and sharded_master_fails()):
        out.append(f"model.qk_clip with optimizer.optimizer={opt.optimizer} and the distributed optimizer: "
                   f"{package_of(_MLA)}'s clip_qk cannot scale the sharded fp32 master weights (Megatron-LM PR "
                   "7382); use a Muon optimizer (MuonClip), or set optimizer.use_distributed_optimizer=false and "
                   "ddp.use_distributed_optimizer=false")
    return out
