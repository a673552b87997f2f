"""``recipes.architecture.Architecture`` parsed from the shipped HF configs, against the published figures.

Expected values are read by hand from the model cards and reports as collected in the project's reference
notes (Kimi K2: arXiv 2507.20534 and Kimi-K2-Instruct's config.json; Qwen3: the Qwen3 technical report and
model cards), not from the code under test.
"""

from __future__ import annotations

import pytest

from recipes.architecture import Architecture, LatentAttention, MixtureOfExperts
from recipes.models import MODELS

pytestmark = pytest.mark.once


def test_kimi_k2():
    arch = MODELS["kimi_k2"].architecture
    assert (arch.family, arch.hf_architecture) == ("kimi_k2", "DeepseekV3ForCausalLM")
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size) == (61, 7168, 18432, 163840)
    assert (arch.num_attention_heads, arch.num_kv_heads) == (64, 64)
    assert arch.attention == "mla" and not arch.qk_norm and not arch.attention_bias  # MLA, no QK-norm
    assert arch.mla == LatentAttention(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128)
    assert arch.mla.qk_head_dim == 192
    # first_k_dense_replace 1: layer 0 dense, layers 1-60 MoE
    assert arch.moe == MixtureOfExperts(experts=384, top_k=8, ffn_hidden_size=2048, shared_experts=1, router="sigmoid",
                                        expert_bias=True, layers=tuple(range(1, 61)))
    assert arch.dense_layers == (0,) and arch.is_moe(1) and not arch.is_moe(0)
    assert arch.moe.shared_ffn_hidden_size == 2048
    assert arch.tie_word_embeddings is False and arch.max_position_embeddings == 131072


def test_qwen3_30b_a3b():
    arch = MODELS["qwen3_30b_a3b"].architecture
    assert (arch.family, arch.hf_architecture) == ("qwen3_moe", "Qwen3MoeForCausalLM")
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (48, 2048, 151936)
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (32, 4, 128)
    assert arch.attention == "gqa" and arch.mla is None and arch.qk_norm and not arch.attention_bias
    moe = arch.moe
    assert (moe.experts, moe.top_k, moe.ffn_hidden_size, moe.shared_experts) == (128, 8, 768, 0)
    assert moe.layers == tuple(range(48)) and arch.dense_layers == ()  # every layer is MoE
    assert arch.tie_word_embeddings is False


def test_qwen3_8b():
    arch = MODELS["qwen3_8b"].architecture
    assert (arch.family, arch.hf_architecture) == ("qwen3", "Qwen3ForCausalLM")
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size) == (36, 4096, 12288, 151936)
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (32, 8, 128)
    assert arch.attention == "gqa" and arch.qk_norm and not arch.attention_bias
    assert arch.moe is None and arch.moe_layers == () and arch.dense_layers == tuple(range(36))
    assert arch.tie_word_embeddings is False


@pytest.mark.parametrize(("name", "layers", "hidden", "heads", "kv", "ffn", "tied"), [
    ("qwen3_0p6b", 28, 1024, 16, 8, 3072, True), ("qwen3_1p7b", 28, 2048, 16, 8, 6144, True),
    ("qwen3_4b", 36, 2560, 32, 8, 9728, True), ("qwen3_14b", 40, 5120, 40, 8, 17408, False),
    ("qwen3_32b", 64, 5120, 64, 8, 25600, False),
])
def test_dense_qwen3_table(name, layers, hidden, heads, kv, ffn, tied):
    arch = MODELS[name].architecture
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.ffn_hidden_size,
            arch.tie_word_embeddings, arch.head_dim, arch.moe) == (layers, hidden, heads, kv, ffn, tied, 128, None)


def test_qwen3_235b_a22b():
    arch = MODELS["qwen3_235b_a22b"].architecture
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads) == (94, 4096, 64, 4)
    assert (arch.moe.experts, arch.moe.top_k, arch.moe.ffn_hidden_size) == (128, 8, 1536)


def test_every_model_parses_once_and_agrees_with_its_spec():
    for name, spec in MODELS.items():
        arch = spec.architecture
        assert spec.architecture is arch  # parsed once
        assert arch.family == spec.family, name
        assert spec.num_layers == arch.num_layers
        assert sorted(arch.moe_layers + arch.dense_layers) == list(range(arch.num_layers)), name
        assert spec.is_moe == (arch.moe is not None), name


def test_moe_layer_maps_of_both_styles():
    """DeepSeek-V3: MoE from `first_k_dense_replace` on, every `moe_layer_freq`-th; Qwen3-MoE: every
    `decoder_sparse_step`-th layer (1-based) unless listed in `mlp_only_layers`."""
    base = dict(MODELS["kimi_k2_proxy"].hf_config)
    deepseek = Architecture.from_hf_config({**base, "num_hidden_layers": 8, "first_k_dense_replace": 3,
                                            "moe_layer_freq": 2})
    assert deepseek.moe_layers == (4, 6)
    qwen = dict(MODELS["qwen3_moe_proxy"].hf_config)
    sparse = Architecture.from_hf_config({**qwen, "num_hidden_layers": 8, "decoder_sparse_step": 2,
                                          "mlp_only_layers": [3]})
    assert sparse.moe_layers == (1, 5, 7)
