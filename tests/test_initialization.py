"""Initialization keyed by a parameter's global name (issue 38, ``bridge_ext.initialization``).

- The shard a rank keeps is the one megatron-core's own CPU initialization gives that rank
  (``tensor_parallel.layers._initialize_affine_weight_cpu``, the second implementation), for plain and strided
  (fused gate/up) column- and row-parallel weights.
- Global names: the layer and expert numbers a hand count gives.
- Per family, the redrawn weights have megatron-core's distributions: each matrix's standard deviation and mean
  agree with upstream's draw of the same parameter within the sampling error of their sizes, vectors (norms) are
  upstream's constants, and the draw depends on the seed and the name only.
- That a run from step 0 in every shipped CPU layout starts from the one-process weights and losses is checked by
  the layout matrix (tests/test_layout_matrix.py, ``check_from_scratch``), whose launches it shares.
"""

from __future__ import annotations

import math

import pytest
import torch

from bridge_ext.initialization import global_name, name_seed, shard_of


@pytest.mark.once
@pytest.mark.parametrize("dim, stride", [(0, 1), (0, 2), (1, 1)])
def test_the_shard_is_megatron_cores_own(dim, stride):
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    out, inp, size = 16, 12, 2
    generator = torch.Generator().manual_seed(7)
    full = torch.randn(out, inp, generator=generator)

    def init(tensor):  # megatron-core draws the full master weight with init_method: here, our full tensor
        tensor.copy_(full)

    for rank in range(size):
        shape = (out // size, inp) if dim == 0 else (out, inp // size)
        weight = torch.nn.Parameter(torch.empty(shape))
        _initialize_affine_weight_cpu(weight, out, inp, shape[dim], dim, init, stride=stride, rank=rank,
                                      world_size=size, skip_set_tensor_parallel_attributes=True)
        assert torch.equal(shard_of(full, dim=dim, stride=stride, rank=rank, size=size), weight.data), (rank, dim)


@pytest.mark.once
def test_global_names_count_layers_and_experts_across_ranks():
    # pipeline stage 2 of 2 holding global layers 2 and 3 as local 0 and 1; EP rank 1 of 2 with 4 local experts
    layers = {0: 2, 1: 3}.__getitem__
    name = global_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", layer_number=layers,
                       first_expert=4)
    assert name == "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"
    assert global_name("decoder.layers.0.mlp.experts.linear_fc2.weight2", layer_number=layers,
                       first_expert=4) == "decoder.layers.2.mlp.experts.linear_fc2.weight6"  # TE's grouped experts
    assert global_name("module.decoder.layers.0.self_attention.linear_qkv.weight", layer_number=layers,
                       first_expert=0) == "module.decoder.layers.2.self_attention.linear_qkv.weight"
    assert global_name("embedding.word_embeddings.weight", layer_number=layers, first_expert=0) == \
        "embedding.word_embeddings.weight"
    assert name_seed(1234, "a") == name_seed(1234, "a") != name_seed(1235, "a") != name_seed(1234, "b")
    assert 0 <= name_seed(1234, "a") < 2**63


def _weights_at_init(recipe: str, *, seed: int = 1234) -> tuple[dict, dict]:
    """Upstream's and our weights of one process's model: hooks before and after ours, in one 1-iteration run."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from bridge_ext.api import prepare_for_this_machine, recipe_config
    from bridge_ext.process_state import reset_megatron_globals

    upstream, ours = {}, {}

    def capture(into):
        def hook(model):
            for chunk in model:
                into.update({n: p.detach().clone() for n, p in chunk.named_parameters()})
            return model
        return hook

    reset_megatron_globals()
    try:
        cfg = recipe_config(recipe, overrides=["train.train_iters=1", "checkpoint.save=null", "checkpoint.load=null",
                                               f"rng.seed={seed}", "logger.log_interval=1"])
        callbacks = prepare_for_this_machine(cfg, data="mock")  # registers init_by_name
        cfg.model.register_pre_wrap_hook(capture(upstream), prepend=True)
        cfg.model.register_pre_wrap_hook(capture(ours))
        pretrain(cfg, forward_step, callbacks=callbacks)
    finally:
        reset_megatron_globals()
    return upstream, ours


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("recipe", ["qwen3_proxy_muon", "qwen3_moe_proxy_muon", "kimi_k2_proxy_muon",
                                    "moonlight_proxy_muon"])
def test_redrawn_weights_have_upstreams_distributions(cpu_mode, recipe):
    upstream, ours = _weights_at_init(recipe)
    assert upstream.keys() == ours.keys() and len(ours) > 10
    redrawn = 0
    for name, mine in ours.items():
        theirs = upstream[name]
        if mine.dim() < 2:  # norms and biases: megatron-core's constants, kept
            assert torch.equal(mine, theirs), name
            continue
        redrawn += 1
        assert not torch.equal(mine, theirs), f"{name} was not redrawn"
        n = mine.numel()
        # zero-mean normals: the sample std's relative standard error is 1/sqrt(2n), the mean's std/sqrt(n); 6 sigma
        assert abs(mine.std().item() / theirs.std().item() - 1) < 6 * (1 / math.sqrt(2 * n) * math.sqrt(2)), name
        assert abs(mine.mean().item() - theirs.mean().item()) < 6 * theirs.std().item() * math.sqrt(2 / n), name
    assert redrawn > 5


@pytest.mark.slow
@pytest.mark.once  # the seeding is ours; what each stack's modules are named is checked per stack above
def test_the_draw_depends_on_the_seed_and_the_name_only(cpu_mode):
    _, first = _weights_at_init("kimi_k2_proxy_muon", seed=1234)
    _, again = _weights_at_init("kimi_k2_proxy_muon", seed=1234)
    _, other = _weights_at_init("kimi_k2_proxy_muon", seed=99)
    matrices = [n for n, p in first.items() if p.dim() >= 2]
    assert all(torch.equal(first[n], again[n]) for n in matrices)
    assert not any(torch.equal(first[n], other[n]) for n in matrices)
    # two experts of one layer, and one expert in two layers, are different draws
    experts = sorted(n for n in matrices if ".local_experts." in n and n.endswith("linear_fc1.weight"))
    assert len(experts) >= 4 and not torch.equal(first[experts[0]], first[experts[1]])
