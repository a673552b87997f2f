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

import importlib
from types import SimpleNamespace
from typing import Any

from bridge_ext.patches.core import Patch
from bridge_ext.stack import UpstreamDrift, package_of

__all__ = ["PATCHES", "clip_linear_qkv_per_group", "gqa_clip_fails_on_a_shard", "layout_problems"]

_GQA = "megatron.core.transformer.attention"


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
