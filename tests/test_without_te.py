"""A GPU run where Transformer Engine is not installed (bridge_ext/without_te.py): only what needs TE changes.

The GPU tier ran this path on an H200 (docs/launch.md); here the config it makes is checked field by field."""

from __future__ import annotations

import pytest

import recipes
from bridge_ext.build import build_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["kimi_k2_proxy_muon", "qwen3_0p6b_adamw"])
def test_local_spec_bf16_kept(name):
    from bridge_ext import patches
    from bridge_ext.without_te import configure_without_te, local_layer_spec

    recipe = recipes.get_recipe(name)
    cfg = build_config(recipe, layout="h200x1")
    before = {k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "tensor_model_parallel_size", "seq_length")}
    assert cfg.model.gradient_accumulation_fusion is True  # the recipe targets TE (build.model_provider)
    note = configure_without_te(cfg)
    model = cfg.model
    assert model.transformer_impl == "local" and model.gradient_accumulation_fusion is False
    assert not model.masked_softmax_fusion and not model.apply_rope_fusion and not model.moe_grouped_gemm
    assert model.fp8 is None and not model.moe_permute_fusion
    # precision, optimizer and sizes are the recipe's: a GPU run in bf16
    assert cfg.mixed_precision == "bf16_mixed" and cfg.optimizer.bf16 is True
    assert {k: getattr(model, k) for k in before} == before
    # the spec is megatron-core's own without TE: the function CPU mode trains with (tests/test_cpu_training.py)
    assert model.transformer_layer_spec is local_layer_spec
    assert "transformer_impl" in note and "gradient_accumulation_fusion" in note
    # the patches training.prepare then applies (scope without-te, none of CPU mode's): this stack's MLA needs the
    # SDPA core attention
    names = {p.name for p in patches.REGISTRY if p.scope == "without-te"}
    assert {"mla-have-te", "mla-core-attention", "moe-te-general-gemm"} == names
    assert "mla-core-attention" in patches.applied_here(["without-te"])


@pytest.mark.stack
def test_the_te_spec_still_fuses_the_norms_the_local_spec_saves_under_its_names():
    """bridge_ext.without_te.te_checkpoint_keys follows megatron-core's Transformer Engine layer spec: read from the
    installed source (TE itself is not needed to read it). The saved keys are checked in the layout matrix."""
    import inspect
    import re

    from megatron.core.models.gpt import gpt_layer_specs

    te_spec = "".join(inspect.getsource(getattr(gpt_layer_specs, name)) for name in (
        "get_gpt_layer_with_transformer_engine_spec", "get_gpt_layer_with_transformer_engine_submodules")
        if hasattr(gpt_layer_specs, name))
    mla = te_spec[te_spec.index("if multi_latent_attention:"):]
    assert re.search(r"linear_q_up_proj = \(\s*backend\.column_parallel_layer_norm_linear\(\)\s*if qk_layernorm", mla)
    assert re.search(r"linear_kv_up_proj = \(\s*backend\.column_parallel_layer_norm_linear\(\)\s*if qk_layernorm", mla)
    assert "q_layernorm=IdentityOp" in mla and "kv_layernorm=IdentityOp" in mla
    assert re.search(r"pre_mlp_layernorm=backend\.layer_norm\([^)]*\) if num_experts else IdentityOp", te_spec)
    assert "linear_qkv=backend.column_parallel_layer_norm_linear()" in te_spec
