"""Muon and QK-clip whose result depends on the parallel layout: patches and launch checks
(tests/test_muon_layouts.py: one Muon step from the same weights on the same batch is the same in every layout).

Patch (scope ``stack``, every run, GPUs too):

* ``qk-clip-gqa-tp-shapes`` (Megatron-LM issue 4646): megatron-core's ``SelfAttention._clip_linear_qkv``
  (``transformer/attention.py``, GQA's half of QK-clip) views the rank's ``linear_qkv`` weight as
  ``(num_query_groups_per_partition, (query_projection_size + 2 * kv_projection_size) //
  num_query_groups_per_partition, -1)``: the first is this rank's number of query groups, the projection sizes
  are the whole model's. With TP > 1 the rows per group come out TP times too many: ``RuntimeError: shape ...
  is invalid for input of size ...`` at the first clip (the run stops at the first step where a head is above
  tau). The patched function takes the rows per group from the whole model's sizes and groups (layout-free),
  then scales each group's query rows by ``eta ** alpha`` and its key rows by ``eta ** (1 - alpha)``, as
  upstream does on one process (bit for bit there). Applies where the installed function, on a TP2 shard of a
  GQA probe, fails or scales other rows than the group's query and key rows (megatron-core 0.16.0 and 0.17.1
  read: fails).

Patch (scope ``stack``: CPU mode, and GPUs without Transformer Engine, where MLA's down-projections are
``ColumnParallelLinear``):

* ``mla-rope-key-grad-tp``: megatron-core's ``MLASelfAttention.get_query_key_value_tensors``
  (``transformer/multi_latent_attention.py``), with ``linear_kv_down_proj`` a ``ColumnParallelLinear`` and TP > 1,
  gathers ``kv_combined`` over TP and splits off the shared rotary key ``k_pos_emb``, which every head uses; each
  rank's backward then holds the gradient of its own heads only, and the gather's backward keeps the rank's slice
  of it: the rotary-key rows of ``linear_kv_down_proj`` get a gradient without the other ranks' heads (the Kimi
  K2 proxy at TP2: those rows 6e-3 away from the 1-process step, every earlier layer 1e-5; tests/
  test_muon_layouts.py). TE's path (``TELinear``, duplicated) gathers ``k_pos_emb`` from the sequence-parallel
  region, whose backward sums over TP. The recompiled function passes the gathered ``kv_combined``'s rotary
  columns through an identity whose backward sums the gradient over TP: the gradient of every head. Applies where that branch has no such reduction (megatron-core 0.16.0, 0.17.1, 0.19.2
  read).

Launch check (:func:`layout_problems`, for ``bridge_ext.build``'s validation; one line each, naming the field):

* ``optimizer.muon_tp_mode=blockwise`` with TP > 1 (or expert TP > 1): megatron-core's ``TensorParallelMuon``
  then orthogonalizes each rank's shard alone (``partition_dim=None``) and scales it by the shard's shape,
  so the update is another one at every TP size (measured on the Qwen3 proxy at TP2: weights 1e-2 away from
  the 1-process step; "duplicated": 6e-8). The presets pin ``duplicated`` (recipes/optimizers.py).
* ``model.moe_use_legacy_grouped_gemm=true`` (the legacy ``GroupedMLP``) with Muon: it stores all of a rank's
  experts as one 2-D weight, which Muon orthogonalizes as one matrix: the experts are mixed, and how many
  depends on EP.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

from bridge_ext.patches.core import Patch, rewrite
from bridge_ext.stack import UpstreamDrift, package_of

__all__ = ["PATCHES", "clip_linear_qkv_per_group", "gqa_clip_fails_on_a_shard", "k_rope_grad_summed",
           "layout_problems", "rope_key_grad_unreduced"]

_GQA = "megatron.core.transformer.attention"
_MLA = "megatron.core.transformer.multi_latent_attention"
_GATHER = "kv_combined = gather_from_tensor_model_parallel_region(kv_combined)"
_SUMMED = ("kv_combined = _bridge_ext_k_rope_grad_summed(gather_from_tensor_model_parallel_region(kv_combined), "
           "self.config.kv_lora_rank, self.tp_group)")


@functools.cache
def _grad_summed_over() -> Any:
    """An autograd function: identity forward, gradient summed over ``group`` backward. Not megatron-core's
    ``copy_to_tensor_model_parallel_region``: its backward all-reduces ``grad.contiguous()`` and returns ``grad``,
    which for a non-contiguous gradient (a slice of ``torch.cat``'s, as here) is a copy: the sum is lost."""
    import torch

    class GradSummedOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            ctx.group = group
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad = grad.contiguous().clone()
            torch.distributed.all_reduce(grad, group=ctx.group)
            return grad, None

    return GradSummedOver


def k_rope_grad_summed(kv_combined: Any, latent: int, group: Any) -> Any:
    """``kv_combined`` (``[..., latent + rope]``, gathered over TP) unchanged, with the gradient of its rotary-key
    columns, shared by every head, summed over the TP group (each rank's backward has its own heads' only)."""
    import torch
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return kv_combined
    rope = _grad_summed_over().apply(kv_combined[..., latent:], group)
    return torch.cat([kv_combined[..., :latent], rope], dim=-1)


def rope_key_grad_unreduced() -> bool:
    """Whether the installed ``MLASelfAttention.get_query_key_value_tensors`` gathers ``kv_combined`` over TP
    (the ``ColumnParallelLinear`` branch) and splits off ``k_pos_emb`` without reducing its gradient over TP."""
    import inspect

    cls = importlib.import_module(_MLA).MLASelfAttention
    function = cls.__dict__.get("get_query_key_value_tensors")
    function = getattr(function, "__wrapped__", function)  # our recompiled one keeps upstream's as __wrapped__
    source = inspect.getsource(function)
    if _GATHER not in source:
        return False
    branch = source.split(_GATHER, 1)[1].split("else:", 1)[0]
    return "k_pos_emb" in branch and "copy_to_tensor_model_parallel_region" not in branch \
        and "reduce_from_tensor_model_parallel_region" not in branch


def clip_linear_qkv_per_group(self: Any, weight: Any) -> Any:
    """``SelfAttention._clip_linear_qkv`` for any TP size: ``weight`` is this rank's ``linear_qkv`` weight,
    ``num_query_groups_per_partition`` groups of ``[q (heads per group x d); k (d); v (d)]`` rows; each group's
    q rows are scaled by ``eta ** alpha`` and its k rows by ``eta ** (1 - alpha)`` (``eta``:
    ``self.qk_clip_balancing_eta``, one per local group). Returns a new tensor; ``weight`` is left as it was."""
    import torch

    groups = self.config.num_query_groups  # the whole model's: rows per group do not depend on TP
    q_rows, kv_rows = self.query_projection_size // groups, self.kv_projection_size // groups
    shaped = weight.reshape(self.num_query_groups_per_partition, q_rows + 2 * kv_rows, -1).clone()
    eta, alpha = self.qk_clip_balancing_eta, self.config.qk_clip_alpha
    shaped[:, :q_rows].mul_(torch.pow(eta, alpha))
    shaped[:, q_rows:q_rows + kv_rows].mul_(torch.pow(eta, 1 - alpha))
    return shaped.view(weight.shape)


def _upstream_clip_linear_qkv() -> Any:
    function = importlib.import_module(_GQA).SelfAttention.__dict__.get("_clip_linear_qkv")
    return getattr(function, "_bridge_ext_original", function)


def _shard_probe(*, tp: int, rank: int) -> tuple[Any, Any, Any]:
    """A GQA layer of 4 heads in 2 query groups (head dim 2, hidden 3), TP ``tp`` rank ``rank``: (stub, its
    ``linear_qkv`` shard, the shard expected after the clip). Group 0's eta is 1/4, group 1's 1/16 (exact square roots), alpha 1/2:
    group g's q and k rows are multiplied by sqrt(eta_g), v rows untouched."""
    import torch

    groups, heads, d, hidden = 2, 4, 2, 3
    rows = heads // groups * d + 2 * d  # per group: q (2 heads x 2), k (2), v (2)
    full = torch.arange(1.0, groups * rows * hidden + 1).view(groups * rows, hidden)
    etas = torch.tensor([0.25, 0.0625])
    expected = full.clone().view(groups, rows, hidden)
    expected[:, : rows - d] *= etas.sqrt().view(groups, 1, 1)  # q and k rows; v (the last d rows) untouched
    local = groups // tp
    mine = slice(rank * local, (rank + 1) * local)
    stub = SimpleNamespace(
        config=SimpleNamespace(qk_clip_alpha=0.5, num_query_groups=groups, num_attention_heads=heads, kv_channels=d),
        num_query_groups_per_partition=local, num_attention_heads_per_partition=heads // tp,
        query_projection_size=heads * d, kv_projection_size=groups * d,
        qk_clip_balancing_eta=etas[mine].view(local, 1, 1))
    shard = full.view(groups, rows, hidden)[mine].reshape(local * rows, hidden).clone()
    return stub, shard, expected[mine].reshape(local * rows, hidden)


def gqa_clip_fails_on_a_shard(function: Any = None) -> bool:
    """Whether ``function`` (default: the installed ``SelfAttention._clip_linear_qkv``) fails on, or scales
    other rows of, a TP2 shard of a GQA probe; it must give the hand-computed result at TP1 (else the probe no
    longer fits the code: :class:`UpstreamDrift`)."""
    import torch

    function = function or _upstream_clip_linear_qkv()
    stub, shard, expected = _shard_probe(tp=1, rank=0)
    try:
        one = function(stub, shard)
    except Exception as exc:  # noqa: BLE001 - a changed signature or attribute: the probe no longer fits
        raise UpstreamDrift(f"{package_of(_GQA)}: SelfAttention._clip_linear_qkv no longer runs on bridge_ext's "
                            f"one-process probe ({type(exc).__name__}: {exc}); bridge_ext.patches.muon_layout "
                            "needs updating") from None
    if not torch.equal(one.reshape(expected.shape), expected):
        raise UpstreamDrift(f"{package_of(_GQA)}: SelfAttention._clip_linear_qkv no longer scales a group's q and "
                            "k rows by eta ** alpha and eta ** (1 - alpha) on one process; "
                            "bridge_ext.patches.muon_layout needs updating")
    for rank in (0, 1):
        stub, shard, expected = _shard_probe(tp=2, rank=rank)
        try:
            got = function(stub, shard)
        except RuntimeError:  # issue 4646: "shape '[1, 16, -1]' is invalid for input of size 24"
            return True
        if got.shape != shard.shape or not torch.equal(got.reshape(expected.shape), expected):
            return True
    return False


def _per_group(old: Any) -> Any:
    function = getattr(old, "__func__", old)

    def _clip_linear_qkv(self: Any, weight: Any) -> Any:
        return clip_linear_qkv_per_group(self, weight)

    _clip_linear_qkv._bridge_ext_original = function  # type: ignore[attr-defined]
    return _clip_linear_qkv


PATCHES: tuple[Patch, ...] = (
    *rewrite(
        "mla-rope-key-grad-tp", _MLA, "MLASelfAttention.get_query_key_value_tensors", ((_GATHER, _SUMMED),),
        area="training", scope="stack",
        upstream="megatron/core/transformer/multi_latent_attention.py MLASelfAttention.get_query_key_value_tensors",
        why="with linear_kv_down_proj a ColumnParallelLinear (no TE) and TP > 1 the shared rotary key's gradient "
            "keeps only this rank's heads: linear_kv_down_proj's rotary rows get another gradient at every TP size; "
            "summed over TP",
        when="the ColumnParallelLinear branch splits k_pos_emb off the TP-gathered kv_combined without reducing "
             "its gradient over TP",
        helpers={"_bridge_ext_k_rope_grad_summed": (
            k_rope_grad_summed, "the rotary key's gradient summed over TP; called by the recompiled function")},
        also_expects=("k_pos_emb",),
        needed=rope_key_grad_unreduced,
    ),
    Patch(
        name="qk-clip-gqa-tp-shapes", area="optimizer", scope="stack", module=_GQA,
        attr="SelfAttention._clip_linear_qkv",
        upstream="megatron/core/transformer/attention.py SelfAttention._clip_linear_qkv (Megatron-LM issue 4646)",
        why="GQA's QK-clip views the rank's linear_qkv shard with the whole model's q/k/v sizes over the rank's "
            "query groups: with TP > 1 a shape error at the first clip; rows per group taken from the whole model",
        when="the installed function fails on, or scales other rows of, a TP2 shard of a GQA probe",
        needed=gqa_clip_fails_on_a_shard,
        snippets=("self.num_query_groups_per_partition", "self.qk_clip_balancing_eta"),
        accepts=lambda function: callable(function) and not hasattr(function, "_bridge_ext_original"),
        make=_per_group,
    ),
)


def _get(cfg: Any, part: str, name: str, default: Any = None) -> Any:
    return getattr(getattr(cfg, part, None), name, default)


def layout_problems(cfg: Any) -> list[str]:
    """Muon settings under which this run's update would depend on its layout (module docstring); one line
    each, naming the field and the fix. Reads ``cfg`` (a ``ConfigContainer`` with the layout's sizes)."""
    if _get(cfg, "optimizer", "optimizer") not in ("muon", "dist_muon"):
        return []
    out = []
    tp = _get(cfg, "model", "tensor_model_parallel_size", 1) or 1
    etp = _get(cfg, "model", "expert_tensor_parallel_size", None) or tp
    experts = _get(cfg, "model", "num_moe_experts", None)
    if _get(cfg, "optimizer", "muon_tp_mode") == "blockwise" and (tp > 1 or (experts and etp > 1)):
        sizes = f"TP{tp}" + (f" ETP{etp}" if experts and etp != tp else "")
        out.append(f"optimizer.muon_tp_mode=blockwise with {sizes}: each tensor-parallel rank orthogonalizes its own "
                   "shard, so Muon's update depends on the layout; set optimizer.muon_tp_mode=duplicated (the "
                   "presets' choice)")
    if experts and _get(cfg, "model", "moe_use_legacy_grouped_gemm", False):
        out.append("model.moe_use_legacy_grouped_gemm=true with Muon: the legacy GroupedMLP holds a rank's experts "
                   "as one matrix, which Muon orthogonalizes as one (experts mixed, how many depends on EP); set "
                   "model.moe_use_legacy_grouped_gemm=false")
    return out
