"""Each patch row proves it is needed (issue 39): with the row off, the bug it fixes shows on the stacks where it
applies; where it does not apply, the installed code no longer has the bug's cause. Rows proven elsewhere:
``tp-weight-attributes-without-init`` (tests/test_tp_weight_attributes.py), ``mla-rope-key-grad-tp`` and
``qk-clip-gqa-tp-shapes`` (tests/test_muon_layouts.py: TP2 against one process), the QK-clip and Muon rows
(tests/test_upstream_muon_bugs.py), ``ddp-hook-cycle`` and ``manual-gc-restored`` (tests/test_cpu_mode.py).
Expected values are upstream's own behaviour (its exception, its attributes), never our code's output.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def moonlight(one_process_model_parallel):
    """The Moonlight proxy's validated CPU config (MLA without a query low-rank, QK layernorm on)."""
    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from recipes import get_recipe

    cfg = build_config(get_recipe("moonlight_proxy_muon"), layout="cpu")
    configure_for_cpu(cfg)
    cfg.validate()
    assert cfg.model.q_lora_rank is None and cfg.model.qk_layernorm
    return cfg.model


def _attention_submodules(block):
    return block.layer_specs[0].submodules.self_attention.submodules


def test_mla_q_projection_without_norm(moonlight):
    """megatron-core 0.19's resolver fuses a norm into ``linear_q_proj`` without a query low-rank: without TE there
    is no fused class (RuntimeError); the row's resolver subclass keeps the spec's plain linear. Before 0.19 there
    is no resolver and MLA builds the spec's ``linear_q_proj``."""
    import importlib.util

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from bridge_ext import patches
    from bridge_ext.without_te import local_layer_spec

    applies = "mla-q-projection-without-norm" in patches.applied_here(["stack"])
    has_resolver = importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None
    assert applies == has_resolver
    if not has_resolver:
        return
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    from bridge_ext.patches.transformer import plain_q_projection_resolver

    submodules = _attention_submodules(local_layer_spec(moonlight))
    with pytest.raises(RuntimeError, match="qk_layernorm requires TransformerEngine"):
        QKNormConfigResolver(moonlight, submodules).resolve()  # the row off
    assert plain_q_projection_resolver()(moonlight, submodules).resolve()["linear_q_proj"] is ColumnParallelLinear


def test_the_local_spec_leaves_out_megatrons_unused_q_norm(moonlight):
    """megatron-core's own local MLA spec sets ``q_layernorm`` whenever ``qk_layernorm`` is on; 0.19's resolver
    refuses it without a query low-rank (ValueError), 0.16-0.18 never build it there. Ours leaves it out."""
    import importlib.util

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from bridge_ext.without_te import local_layer_spec

    upstream = _attention_submodules(get_gpt_decoder_block_spec(moonlight, use_transformer_engine=False))
    assert upstream.q_layernorm not in (None, IdentityOp)
    assert _attention_submodules(local_layer_spec(moonlight)).q_layernorm is IdentityOp
    if importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None:
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

        with pytest.raises(ValueError, match="q_lora_rank is None"):
            QKNormConfigResolver(moonlight, upstream).resolve()


def test_torch_norm_sequence_parallel(cpu_mode):
    """megatron-core's ``WrappedTorchNorm`` asserts no sequence parallelism (the row off: AssertionError); with the
    row the norm is built and its weight flagged ``sequence_parallel`` as TE's and Apex's norms flag theirs."""
    import copy

    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from bridge_ext.cpu import enable_cpu_mode

    enable_cpu_mode()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               tensor_model_parallel_size=2, sequence_parallel=True)
    upstream = vars(WrappedTorchNorm)["__new__"].__func__._bridge_ext_original
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        upstream(WrappedTorchNorm, config, 8)
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    plain = copy.copy(config)
    plain.sequence_parallel = False
    assert getattr(WrappedTorchNorm(plain, 8).weight, "sequence_parallel", False) is False


def test_mla_latent_norm_eps_is_deepseek_v3s(moonlight):
    """megatron-core's MLA normalizes the KV latent with the block's ``layernorm_epsilon`` (Moonlight: 1e-5);
    transformers' ``DeepseekV3Attention`` (the released modeling code) builds that norm with RMSNorm's default.
    The row (``mla-latent-norm-eps``; its conversion twin shares the code) gives Megatron's the same eps."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from bridge_ext import patches
    from bridge_ext.hf import load_hf_config
    from recipes import get_recipe
    from recipes.models import HF_CONFIGS

    patches.apply("stack")
    hf = load_hf_config(HF_CONFIGS / get_recipe("moonlight_proxy_muon").model.name)
    want = DeepseekV3Attention(hf, layer_idx=0).kv_a_layernorm.variance_epsilon
    assert hf.rms_norm_eps == moonlight.layernorm_epsilon == 1e-5 and want != hf.rms_norm_eps
    model = moonlight.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
    attention = model.decoder.layers[0].self_attention
    assert attention.kv_layernorm.eps == want
