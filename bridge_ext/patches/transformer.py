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
* ``mla-q-projection-without-norm`` / ``mla-unused-q-norm`` (both scopes; megatron-core 0.19's
  ``QKNormConfigResolver``): with ``q_lora_rank`` None (Moonlight) the query comes straight from the block's
  normalized input, as in DeepSeek-V3's code; 0.19 fuses an extra norm into ``linear_q_proj`` (TE) or refuses the
  local spec's unused ``q_layernorm`` (CPU).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

from bridge_ext.muon.checks import nonpositive_logit_nans
from bridge_ext.muon.clip import floored_clip_qk
from bridge_ext.patches.core import Area, Patch, rewrite
from bridge_ext.stack import UpstreamDrift, package_of

__all__ = ["AREA", "HF_LATENT_NORM_EPS", "PATCHES", "use_hf_latent_norm_eps"]

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
_UNUSED_Q_NORM = "self._raise_unused_q_norm()"


def _resolver_has(code: str) -> Callable[[], bool]:
    def needed() -> bool:
        if importlib.util.find_spec(_QK_NORM_RESOLVER) is None:
            return False
        resolver = importlib.import_module(_QK_NORM_RESOLVER).QKNormConfigResolver
        return code in inspect.getsource(resolver)

    return needed


def _q_without_lora(scope: str, suffix: str) -> tuple[Patch, ...]:
    upstream = "megatron/core/transformer/mla_qk_norm_config.py QKNormConfigResolver (megatron-core 0.19)"
    return (
        *rewrite(
            f"mla-q-projection-without-norm{suffix}", _QK_NORM_RESOLVER,
            "QKNormConfigResolver._resolve_mla_qk_layernorm",
            ((_FUSED_Q_PROJ, "linear_q_proj_cls = self._non_fused_or_default("),),
            area=AREA, scope=scope, upstream=upstream, needed=_resolver_has(_FUSED_Q_PROJ),
            why="with q_lora_rank None (Moonlight) linear_q_proj becomes a fused norm+linear: a second RMSNorm with "
                "its own weight on the already normalized input, which DeepSeek-V3's q_proj does not have (and no "
                "HF tensor maps to); the spec's plain linear is kept",
            when="where the resolver fuses a norm into linear_q_proj without a query low-rank (megatron-core 0.19)"),
        *rewrite(
            f"mla-unused-q-norm{suffix}", _QK_NORM_RESOLVER, "QKNormConfigResolver._reject_common_spec_conflicts",
            ((_UNUSED_Q_NORM, "pass  # bridge_ext: not built without q_lora_rank, as in megatron-core <= 0.18"),),
            area=AREA, scope=scope, upstream=upstream, needed=_resolver_has(_UNUSED_Q_NORM),
            why="megatron-core's own local (CPU) MLA spec sets q_layernorm whenever qk_layernorm is on, and the "
                "resolver refuses it when q_lora_rank is None: a Moonlight-shaped model cannot be built without TE",
            when="where the resolver refuses an unused q_layernorm (megatron-core 0.19)"),
    )


PATCHES: tuple[Patch, ...] = (
    _clip_patch("mla", _MLA_MODULE, "MLASelfAttention", "multi_latent_attention.py"),
    _clip_patch("gqa", "megatron.core.transformer.attention", "SelfAttention", "attention.py"),
    Patch(name="mla-latent-norm-eps", scope="stack", **_LATENT_NORM_EPS),
    Patch(name="mla-latent-norm-eps (conversion)", scope="conversion", **_LATENT_NORM_EPS),
    *_q_without_lora("stack", ""),
    *_q_without_lora("conversion", " (conversion)"),
)
