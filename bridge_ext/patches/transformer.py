"""megatron-core's attention (``megatron/core/transformer/``): known bugs of QK-clip, and MLA as DeepSeek-V3's code
has it. Area ``transformer``; conversion and training build the same model, so the MLA rows come in both scopes.

QK-clip (scope ``stack``, every run, GPUs too; tests/test_upstream_muon_bugs.py):

* ``qk-clip-nonpositive-logit-mla`` / ``-gqa`` (Megatron-LM PR 7382): megatron-core's ``clip_qk``
  (``transformer/multi_latent_attention.py`` ``MLASelfAttention.clip_qk``; ``transformer/attention.py``
  ``SelfAttention.clip_qk``) scales each head by ``eta = clamp(tau / S_max, max=1)``, q by ``eta ** alpha``
  and k by ``eta ** (1 - alpha)``, once any head of the layer is above tau. A head whose max logit S_max is
  negative gets ``eta < 0``: ``eta ** alpha`` is NaN in its q and k weights (and their fp32 master), then in
  the whole run. MuonClip (Kimi K2, arXiv 2507.20534, Algorithm 1) scales a head by
  ``gamma = min(1, tau / S_max)`` only where S_max > tau. The patch floors the maxima at tau before
  upstream's ``clip_qk`` runs (``bridge_ext.muon.clip.floored_clip_qk``): every head at or under tau then gets
  ``eta = tau / tau = 1`` exactly (weights bit for bit untouched, as upstream leaves a head in (0, tau]); heads
  above tau are scaled as before. Applies where the installed ``clip_qk``, run on a two-head probe whose second
  head's max logit is negative, writes NaN into that head or changes it
  (``bridge_ext.muon.checks.nonpositive_logit_nans``; every release read: megatron-core 0.16.0-0.19.2).

The launch check for ``model.qk_clip`` under the distributed optimizer is ``bridge_ext.muon.checks``.

MLA (scopes ``stack`` and ``conversion``; Moonlight's training and conversion):

* ``mla-latent-norm-eps`` (scopes ``conversion`` and ``stack``: conversion and training build the same model):
  megatron-core's MLA normalizes the query and KV latents with the block's ``layernorm_epsilon``; DeepSeek-V3's
  modeling code (transformers' and the releases' own) uses RMSNorm's default 1e-6 there, whatever ``rms_norm_eps``
  says. Equal for DeepSeek-V3 and Kimi K2 (1e-6); Moonlight's 1e-5 would differ.
* ``mla-q-projection-without-norm`` (both scopes; megatron-core 0.19's ``QKNormConfigResolver``): with
  ``q_lora_rank`` None (Moonlight) the query comes straight from the block's normalized input, as in DeepSeek-V3's
  code; 0.19 fuses an extra norm into ``linear_q_proj`` (TE; without TE: no fused class, RuntimeError). MLA's
  ``_resolve_qk_norm_config`` (upstream's one call of the resolver) uses a subclass of upstream's resolver that
  keeps the plain linear there; no upstream source is edited. (0.19 also refuses megatron-core's local spec's
  unused ``q_layernorm`` without a query low-rank: ``bridge_ext.without_te.local_layer_spec``, our spec, leaves it
  out.)

Layout (tests/test_muon_layouts.py: one Muon step from the same weights on the same batch is the same in every
layout).

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

Hook (scope ``stack``: CPU mode, and GPUs without Transformer Engine, where MLA's down-projections are
``ColumnParallelLinear``):

* ``mla-rope-key-grad-tp``: megatron-core's ``MLASelfAttention.get_query_key_value_tensors``
  (``transformer/multi_latent_attention.py``), with ``linear_kv_down_proj`` a ``ColumnParallelLinear`` and TP > 1,
  gathers ``kv_combined`` over TP and splits off the shared rotary key ``k_pos_emb``, which every head uses; each
  rank's backward then holds the gradient of its own heads only, and the gather's backward keeps the rank's slice
  of it: the rotary-key rows of ``linear_kv_down_proj`` get a gradient without the other ranks' heads (the Kimi
  K2 proxy at TP2: those rows 6e-3 away from the 1-process step, every earlier layer 1e-5; tests/
  test_muon_layouts.py). TE's path (``TELinear``, duplicated: full-width output) gathers ``k_pos_emb`` from the
  sequence-parallel region, whose backward sums over TP. A pre-wrap hook puts a forward hook on each such
  ``linear_kv_down_proj`` (nothing upstream is changed): its output gathered over TP there, the rotary columns
  through an identity whose backward sums the gradient over TP (with sequence parallelism: scattered back to the
  sequence-parallel region instead, where upstream's own gather of ``k_pos_emb`` sums it), so upstream takes its
  full-width branch. Applies where the shard branch has no such reduction (megatron-core 0.16.0, 0.17.1, 0.19.2
  read). Until 2026-12-06 the row recompiled ``get_query_key_value_tensors``.

Layout-dependent settings that are not upstream bugs are the presets' and the launch checks' (``bridge_ext.muon.
checks.launch_problems``): the presets pin ``optimizer.muon_tp_mode=duplicated`` (``blockwise`` orthogonalizes each
TP shard alone: the Qwen3 proxy at TP2 lands 1e-2 away from the 1-process step; "duplicated": 6e-8), and the
legacy ``GroupedMLP`` (all of a rank's experts as one matrix) is refused with Muon.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from bridge_ext.muon.checks import nonpositive_logit_nans
from bridge_ext.muon.clip import floored_clip_qk
from bridge_ext.stack import UpstreamDrift, package_of
from bridge_ext.upstream_patch import Area, Patch

__all__ = ["AREA", "HF_LATENT_NORM_EPS", "PATCHES", "clip_linear_qkv_per_group", "gqa_clip_fails_on_a_shard",
           "gather_kv_down_proj_with_rope_grad_summed", "k_rope_grad_summed", "plain_q_projection_resolver",
           "rope_key_grad_unreduced", "use_hf_latent_norm_eps"]

AREA: Area = "transformer"


def _clip_patch(kind: str, module: str, cls: str, path: str) -> Patch:
    return Patch(
        name=f"qk-clip-nonpositive-logit-{kind}", area=AREA, scope="stack", module=module,
        attr=f"{cls}.clip_qk",
        upstream=f"megatron/core/transformer/{path} {cls}.clip_qk (Megatron-LM PR 7382)",
        why="a head whose max attention logit is < 0 gets eta = tau / S_max < 0 and eta ** alpha = NaN in its "
            "query and key weights; the maxima are floored at tau first (eta = 1: the head untouched, as "
            "MuonClip's gamma = min(1, tau / S_max))",
        when=f"{cls}.clip_qk, on a two-head probe with one max logit negative, writes NaN into that head",
        needed=lambda: nonpositive_logit_nans(module, cls),
        snippets=("self.core_attention.current_max_attn_logits", "self.config.qk_clip_threshold"),
        accepts=lambda function: callable(function) and not hasattr(function, "_bridge_ext_original"),
        make=floored_clip_qk,
    )


# transformers models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention (and the releases' own
# modeling_deepseek.py): q_a_layernorm / kv_a_layernorm = DeepseekV3RMSNorm(rank), whose eps defaults to 1e-6; only
# the block norms (input, post-attention, final) take config.rms_norm_eps.
HF_LATENT_NORM_EPS = 1e-6
_MLA_MODULE = "megatron.core.transformer.multi_latent_attention"
_BLOCK_EPS = "eps=self.config.layernorm_epsilon"
# where MLA keeps its latent norms: separate norms (local spec, CPU) or fused into the up projection (TE's
# LayerNormColumnParallelLinear, whose norm reads its own `eps` in forward)
_LATENT_NORMS = ("q_layernorm", "kv_layernorm", "linear_q_up_proj", "linear_kv_up_proj")


def _mla_classes() -> list[type]:
    """megatron-core's MLA attention classes whose own ``__init__`` builds the latent norms (MLASelfAttention;
    0.19's FusedMLASelfAttention builds its own)."""
    module = importlib.import_module(_MLA_MODULE)
    base = module.MultiLatentAttention
    return [cls for cls in vars(module).values() if isinstance(cls, type) and issubclass(cls, base)
            and cls is not base and "__init__" in vars(cls) and "kv_layernorm" in inspect.getsource(cls.__init__)]


def _latent_norms_take_the_block_eps() -> bool:
    classes = _mla_classes()
    if not classes:
        raise UpstreamDrift(f"{package_of(_MLA_MODULE)}: no MLA attention class in {_MLA_MODULE} builds kv_layernorm")
    return any(_BLOCK_EPS in inspect.getsource(cls.__init__) for cls in classes)


def use_hf_latent_norm_eps(attention: Any) -> None:
    """Give an MLA attention module's query / KV latent norms DeepSeek-V3's eps (:data:`HF_LATENT_NORM_EPS`)."""
    for name in _LATENT_NORMS:
        module = getattr(attention, name, None)
        if isinstance(getattr(module, "eps", None), float):  # a norm, or a linear with its norm fused in
            module.eps = HF_LATENT_NORM_EPS


def _install_hf_latent_norm_eps() -> None:
    """Wrap each MLA class's ``__init__`` (once, whichever scope comes first) to set the latent norms' eps."""
    import functools

    for cls in _mla_classes():
        original = vars(cls)["__init__"]
        if getattr(original, "_bridge_ext_latent_norm_eps", False):
            continue

        @functools.wraps(original)
        def __init__(self, *args, __original=original, **kwargs):
            __original(self, *args, **kwargs)
            use_hf_latent_norm_eps(self)

        __init__._bridge_ext_latent_norm_eps = True
        cls.__init__ = __init__


_LATENT_NORM_EPS = dict(
    area=AREA, module=_MLA_MODULE, attr="MLASelfAttention.__init__",
    upstream="megatron/core/transformer/multi_latent_attention.py MLASelfAttention.__init__ (q_layernorm, "
             "kv_layernorm; TE: the up projections' fused norm) vs transformers' DeepseekV3Attention",
    why="the latent norms take the block's layernorm_epsilon; DeepSeek-V3's code uses 1e-6 there: with "
        "Moonlight's rms_norm_eps 1e-5 Megatron's logits differ from transformers' by ~1e-4 on a tiny fp32 model",
    when="where MLA builds its latent norms with eps=config.layernorm_epsilon (a no-op for configs whose "
         "rms_norm_eps is 1e-6: DeepSeek-V3, Kimi K2)",
    needed=_latent_norms_take_the_block_eps, snippets=(_BLOCK_EPS,), install=_install_hf_latent_norm_eps,
)

# megatron-core 0.19 megatron/core/transformer/mla_qk_norm_config.py QKNormConfigResolver (0.16-0.18 have none:
# MLASelfAttention builds linear_q_proj from the spec and no q_layernorm without q_lora_rank).
_QK_NORM_RESOLVER = "megatron.core.transformer.mla_qk_norm_config"
_FUSED_Q_PROJ = "linear_q_proj_cls = self._mla_fused_linear_or_default("


def _resolver_has(code: str) -> Callable[[], bool]:
    def needed() -> bool:
        if importlib.util.find_spec(_QK_NORM_RESOLVER) is None:
            return False
        resolver = importlib.import_module(_QK_NORM_RESOLVER).QKNormConfigResolver
        return code in inspect.getsource(resolver)

    return needed


@functools.cache
def plain_q_projection_resolver() -> type:
    """megatron-core 0.19's ``QKNormConfigResolver``, subclassed: without a query low-rank, ``linear_q_proj`` stays
    a plain linear (the spec's, or the backend's where the spec names the fused one), as megatron-core 0.16-0.18
    build it and DeepSeek-V3's ``q_proj`` is; every other decision is upstream's."""
    base = importlib.import_module(_QK_NORM_RESOLVER).QKNormConfigResolver

    class PlainQProjectionResolver(base):  # type: ignore[misc, valid-type]
        def _mla_fused_linear_or_default(self, module_spec: Any, module_name: str) -> Any:
            if module_name != "linear_q_proj":
                return super()._mla_fused_linear_or_default(module_spec, module_name)
            plain = self.linear_impl if module_spec is None or self._is_fused_norm_linear(module_spec) else module_spec
            return self._non_fused_or_default(plain, module_name)

    return PlainQProjectionResolver


def _resolving_with_plain_q_projection(old: Any) -> Any:
    def _resolve_qk_norm_config(self: Any, submodules: Any) -> Any:
        return plain_q_projection_resolver()(self.config, submodules).resolve()

    _resolve_qk_norm_config._bridge_ext_original = old  # type: ignore[attr-defined]
    return _resolve_qk_norm_config


def _q_without_lora(scope: str, suffix: str) -> Patch:
    return Patch(
        name=f"mla-q-projection-without-norm{suffix}", area=AREA, scope=scope, module=_MLA,
        attr="MLASelfAttention._resolve_qk_norm_config",
        upstream="megatron/core/transformer/mla_qk_norm_config.py QKNormConfigResolver._resolve_mla_qk_layernorm "
                 "(megatron-core 0.19), called by MLASelfAttention._resolve_qk_norm_config",
        why="with q_lora_rank None (Moonlight) linear_q_proj becomes a fused norm+linear: a second RMSNorm with its "
            "own weight on the already normalized input, which DeepSeek-V3's q_proj does not have (and no HF tensor "
            "maps to); MLA resolves with a subclass of upstream's resolver that keeps a plain linear there",
        when="where the resolver fuses a norm into linear_q_proj without a query low-rank (megatron-core 0.19)",
        needed=_resolver_has(_FUSED_Q_PROJ),
        snippets=("return QKNormConfigResolver(self.config, submodules).resolve()",),
        elsewhere=((_QK_NORM_RESOLVER, (_FUSED_Q_PROJ, "def _mla_fused_linear_or_default(self, module_spec, "
                                        "module_name):", "def _non_fused_or_default(self, module_spec, module_name):",
                                        "self.linear_impl = ")),),
        accepts=callable,  # upstream's, or ours (the other scope's row applied first: the same change again)
        make=_resolving_with_plain_q_projection,
    )


_GQA = "megatron.core.transformer.attention"
_MLA = "megatron.core.transformer.multi_latent_attention"
_GATHER = "kv_combined = gather_from_tensor_model_parallel_region(kv_combined)"


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

    source = inspect.getsource(importlib.import_module(_MLA).MLASelfAttention.get_query_key_value_tensors)
    if _GATHER not in source:
        return False
    branch = source.split(_GATHER, 1)[1].split("else:", 1)[0]
    return "k_pos_emb" in branch and "copy_to_tensor_model_parallel_region" not in branch \
        and "reduce_from_tensor_model_parallel_region" not in branch


def _gathered_with_rope_grad_summed(attention: Any) -> Callable[..., Any]:
    """A forward hook for ``attention.linear_kv_down_proj``: a TP shard of ``kv_combined`` (``[s, b, (latent +
    rope) / TP]``) comes out whole, its rotary columns' gradient summed over TP; with sequence parallelism it is
    scattered back to ``[s / TP, b, latent + rope]``, the shape upstream's full-width branch takes, where its own
    gather of ``k_pos_emb`` from the sequence-parallel region sums that gradient."""
    config = attention.config

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        kv_combined, bias = output
        if kv_combined.size(-1) == config.kv_lora_rank + config.qk_pos_emb_head_dim:
            return output
        whole = gather_from_tensor_model_parallel_region(kv_combined, group=attention.tp_group)
        if config.sequence_parallel:
            return scatter_to_sequence_parallel_region(whole, group=attention.tp_group), bias
        return k_rope_grad_summed(whole, config.kv_lora_rank, attention.tp_group), bias

    return hook


def gather_kv_down_proj_with_rope_grad_summed(model: list[Any]) -> list[Any]:
    """Pre-wrap hook: every ``MLASelfAttention`` of ``model`` whose ``linear_kv_down_proj`` is a
    ``ColumnParallelLinear`` (TP-sharded output) gets :func:`_gathered_with_rope_grad_summed` on it, at TP > 1."""
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    mla = importlib.import_module(_MLA).MLASelfAttention
    for chunk in model:
        for module in chunk.modules():
            down = getattr(module, "linear_kv_down_proj", None)
            if isinstance(module, mla) and isinstance(down, ColumnParallelLinear) \
                    and torch.distributed.get_world_size(module.tp_group) > 1:
                down.register_forward_hook(_gathered_with_rope_grad_summed(module))
    return model


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
                            f"one-process probe ({type(exc).__name__}: {exc}); bridge_ext.patches.transformer "
                            "needs updating") from None
    if not torch.equal(one.reshape(expected.shape), expected):
        raise UpstreamDrift(f"{package_of(_GQA)}: SelfAttention._clip_linear_qkv no longer scales a group's q and "
                            "k rows by eta ** alpha and eta ** (1 - alpha) on one process; "
                            "bridge_ext.patches.transformer needs updating")
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
    _clip_patch("mla", _MLA_MODULE, "MLASelfAttention", "multi_latent_attention.py"),
    _clip_patch("gqa", "megatron.core.transformer.attention", "SelfAttention", "attention.py"),
    Patch(name="mla-latent-norm-eps", scope="stack", **_LATENT_NORM_EPS),
    Patch(name="mla-latent-norm-eps (conversion)", scope="conversion", **_LATENT_NORM_EPS),
    _q_without_lora("stack", ""),
    _q_without_lora("conversion", " (conversion)"),
    Patch(
        name="mla-rope-key-grad-tp", area=AREA, scope="stack",
        module="megatron.bridge.models.model_provider", attr="ModelProviderMixin.register_pre_wrap_hook",
        upstream="megatron/core/transformer/multi_latent_attention.py MLASelfAttention.get_query_key_value_tensors",
        why="with linear_kv_down_proj a ColumnParallelLinear (no TE) and TP > 1 the shared rotary key's gradient "
            "keeps only this rank's heads: linear_kv_down_proj's rotary rows get another gradient at every TP size; "
            "a pre-wrap hook gathers that projection's output with the rotary gradient summed over TP",
        when="the ColumnParallelLinear branch splits k_pos_emb off the TP-gathered kv_combined without reducing "
             "its gradient over TP",
        needed=rope_key_grad_unreduced,
        elsewhere=((_MLA, (_GATHER, "k_pos_emb", "get_pg_size(self.tp_group) > 1 and self.config.sequence_parallel",
                           "gather_from_sequence_parallel_region(k_pos_emb, group=self.tp_group)")),),
        hook=gather_kv_down_proj_with_rope_grad_summed,
    ),
    Patch(
        name="qk-clip-gqa-tp-shapes", area=AREA, scope="stack", module=_GQA,
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
