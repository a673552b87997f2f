"""The patches that build megatron-core's MLA and MoE modules without Transformer Engine (scope ``without-te``, area
``without-te``): CPU mode applies them, and so does a GPU run where TE is not installed (``bridge_ext.training``,
``bridge_ext.without_te``), with none of CPU mode's device stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bridge_ext.stack import module_source
from bridge_ext.upstream_patch import Patch
from bridge_ext.without_te.sdpa_attention import SDPACoreAttention

__all__ = ["PATCHES"]

_SETS_ITS_OWN_HAVE_TE = "    HAVE_TE = True"  # multi_latent_attention.py's own try/except (megatron-core 0.16)
_GEMM_IMPORTED = "        te_general_gemm,\n"  # moe_utils.py imports it in its TE try, and 0.17+ in the except too


def _mla_build_module(build_module: Callable) -> Callable:
    """``build_module`` for multi_latent_attention.py: its local core attention becomes SDPA-based."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def build(spec: Any, *args: Any, **kwargs: Any) -> Any:
        if spec is DotProductAttention or getattr(spec, "module", None) is DotProductAttention:
            return SDPACoreAttention(*args, **kwargs)
        return build_module(spec, *args, **kwargs)

    return build


def _without_te(**fields: Any) -> Patch:
    return Patch(**{"area": "without-te", "scope": "without-te", "when": "without TE (CPU mode, a GPU without TE)",
                    **fields})


PATCHES: tuple[Patch, ...] = (
    _without_te(
        name="mla-have-te", when="without TE, where MLA sets HAVE_TE from its own TE import (megatron-core 0.16; 0.17 "
                                 "imports extensions.transformer_engine's)",
        upstream="megatron/core/transformer/multi_latent_attention.py HAVE_TE, isinstance(self.linear_proj, TELinear)",
        module="megatron.core.transformer.multi_latent_attention",
        attr="HAVE_TE",
        snippets=("HAVE_TE", "isinstance(self.linear_proj, TELinear)"),
        needed=lambda: _SETS_ITS_OWN_HAVE_TE in module_source("megatron.core.transformer.multi_latent_attention"),
        why="without TE, extensions/transformer_engine.py:76 makes `te` a MagicMock, so the import succeeds, "
        "HAVE_TE is True and TELinear is a MagicMock instance: isinstance() raises TypeError",
        make=lambda old: False,
    ),
    _without_te(
        name="moe-te-general-gemm", when="without TE, where only the TE import binds the name (megatron-core 0.16; "
                                         "0.17 also imports a fallback)",
        upstream="megatron/core/transformer/moe/moe_utils.py te_general_gemm (bound only when TE imports)",
        module="megatron.core.transformer.moe.moe_utils",
        attr="te_general_gemm",
        snippets=("te_general_gemm is not None",),
        needed=lambda: module_source("megatron.core.transformer.moe.moe_utils").count(_GEMM_IMPORTED) < 2,
        why="without TE the name is never bound (only imported in a try block): NameError in every router",
        make=lambda old: None,
        must_exist=False,
    ),
    _without_te(
        name="mla-core-attention",
        upstream="megatron/core/transformer/multi_latent_attention.py MLASelfAttention: build_module(core_attention)",
        module="megatron.core.transformer.multi_latent_attention",
        attr="build_module",
        snippets=("self.core_attention = build_module(", "k_channels=self.q_head_dim"),
        why="local DotProductAttention takes no k_channels/v_channels; MLA gets an SDPA core attention",
        make=_mla_build_module,
    ),
)
