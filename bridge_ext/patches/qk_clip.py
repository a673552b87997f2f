"""QK-clip: known upstream bugs and their patches (tests/test_upstream_muon_bugs.py; the others: muon_bugs).

Patches (scope ``stack``, every run, GPUs too):

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
"""

from __future__ import annotations

from bridge_ext.muon.checks import nonpositive_logit_nans
from bridge_ext.muon.clip import floored_clip_qk
from bridge_ext.patches.core import Patch

__all__ = ["PATCHES"]


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
        make=floored_clip_qk,
    )


PATCHES: tuple[Patch, ...] = (
    _clip_patch("mla", "megatron.core.transformer.multi_latent_attention", "MLASelfAttention",
                "multi_latent_attention.py"),
    _clip_patch("gqa", "megatron.core.transformer.attention", "SelfAttention", "attention.py"),
)
