"""megatron-core 0.16/0.17 give a tensor-parallel layer's weight its TP attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``) only when ``perform_initialization`` is on; 0.18 sets them either way
(``bridge_ext/patches/tensor_parallel.py``, row ``tp-weight-attributes-without-init``, scope ``stack``: a
model-provider pre-wrap hook).

Expected values are megatron-core's own: each layer, and two proxy models (Qwen3-MoE: GQA, gated experts; Kimi K2:
MLA, a dense gated MLP, shared experts), built twice in this process, with and without ``perform_initialization``;
after the hook the uninitialized one's weights must carry the initialized one's attributes, and megatron-core's
``TensorParallelMuon.orthogonalize`` (``muon_tp_mode`` duplicated) must pass Newton-Schulz the same partition dim
(without the hook, where the stack needs it: None, i.e. each TP shard orthogonalized alone). One process, TP1: the
attributes do not depend on the TP size.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.stack  # megatron-core 0.16/0.17 need the patch, 0.18+ have the fix

ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")
LAYERS = ("VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear")


@pytest.fixture(scope="module")
def tp_group(one_process_model_parallel):
    """The TP group of a one-process run (world size 1), and megatron-core's RNG tracker for the GPU init path."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    return one_process_model_parallel.get_tensor_model_parallel_group()


def _layer(name: str, *, perform_initialization: bool, use_cpu_initialization: bool, group):
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import layers

    config = ModelParallelConfig(perform_initialization=perform_initialization,
                                 use_cpu_initialization=use_cpu_initialization, params_dtype=torch.float32)
    init = torch.nn.init.ones_
    if name == "VocabParallelEmbedding":
        return layers.VocabParallelEmbedding(16, 4, init_method=init, config=config, tp_group=group)
    if name == "ColumnParallelLinear":  # stride 2: a fused projection's interleaved partitions
        return layers.ColumnParallelLinear(4, 8, config=config, init_method=init, bias=True, gather_output=False,
                                           stride=2, tp_group=group)
    return layers.RowParallelLinear(8, 4, config=config, init_method=init, bias=False, input_is_parallel=True,
                                    skip_bias_add=False, stride=1, tp_group=group)


def _partition_dim_given_to_newton_schulz(weight) -> object:
    """The partition dim megatron-core's ``TensorParallelMuon.orthogonalize`` (tp mode duplicated) passes on for
    ``weight`` (on a stand-in optimizer whose orthogonalize function records it)."""
    import torch

    from bridge_ext.stack import first_defined

    muon = first_defined("TensorParallelMuon", "megatron.core.optimizer.muon",
                         "megatron.core.optimizer.emerging_optimizers")
    seen = []
    stand_in = SimpleNamespace(pg_collection=None, mode="duplicated", tp_mode="duplicated", split_qkv=False,
                               is_qkv_fn=lambda p: False,
                               scaled_orthogonalize_fn=lambda grad, group, dim: seen.append(dim) or grad,
                               # megatron-core 0.19.2
                               scaled_orthogonalize_fn_with_gtp_remat=lambda p, grad, group, dim: seen.append(dim)
                               or grad)
    muon.orthogonalize(stand_in, weight, torch.zeros_like(weight))
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("use_cpu_initialization", [True, False], ids=["cpu-init", "gpu-init"])
@pytest.mark.parametrize("name", LAYERS)
def test_a_weight_has_its_tp_attributes_without_initialization(tp_group, name, use_cpu_initialization):
    from bridge_ext.patches.tensor_parallel import set_missing_tp_attributes, weight_attributes_only_with_initialization

    initialized = _layer(name, perform_initialization=True, use_cpu_initialization=use_cpu_initialization,
                         group=tp_group)
    loaded = _layer(name, perform_initialization=False, use_cpu_initialization=use_cpu_initialization,
                    group=tp_group)
    expected = {key: getattr(initialized.weight, key) for key in ATTRIBUTES}
    assert expected["tensor_model_parallel"] is True and expected["partition_dim"] in (0, 1)  # the init path's
    # the bug the hook fixes, where this stack has it: without it the weight has no partition dim
    assert (getattr(loaded.weight, "partition_dim", -1) == -1) == weight_attributes_only_with_initialization(name)
    set_missing_tp_attributes([loaded])
    assert {key: getattr(loaded.weight, key, None) for key in ATTRIBUTES} == expected
    if name != "VocabParallelEmbedding":  # Muon's matrices (the embedding is AdamW's)
        assert _partition_dim_given_to_newton_schulz(loaded.weight) == expected["partition_dim"]


def _attributes(model) -> dict[str, tuple]:
    return {name: tuple(getattr(param, key, None) for key in ATTRIBUTES) for name, param in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qwen3_moe_proxy_muon", "kimi_k2_proxy_muon"])
def test_every_weight_of_a_model_built_without_initialization_gets_the_init_paths_attributes(tp_group, recipe):
    """The whole model, as a run that loads its weights builds it: the hook gives every parameter the attributes
    megatron-core's init path gives (strides included: a gated ``linear_fc1``'s is 2); without it, on a stack that
    needs it, the linear layers' weights have none."""
    import torch

    from bridge_ext.build import build_config
    from bridge_ext.cpu import configure_for_cpu
    from bridge_ext.patches.tensor_parallel import set_missing_tp_attributes, weight_attributes_only_with_initialization
    from recipes import get_recipe

    def build(perform_initialization: bool):
        cfg = build_config(get_recipe(recipe), layout="cpu")
        configure_for_cpu(cfg)
        cfg.model.perform_initialization = perform_initialization
        cfg.validate()
        torch.manual_seed(0)
        return cfg.model.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]

    want, loaded = _attributes(build(True)), build(False)
    assert sum(v[0] is True for v in want.values()) > 10 and any(v[2] == 2 for v in want.values()), want
    missing = {n for n, v in _attributes(loaded).items() if v != want[n]}
    assert bool(missing) == weight_attributes_only_with_initialization("ColumnParallelLinear"), missing
    set_missing_tp_attributes([loaded])
    assert _attributes(loaded) == want


def test_the_hook_is_registered_exactly_where_the_installed_code_needs_it(tp_group):
    """Applied (and registered on a run's provider) exactly where megatron-core's own ``__init__`` sets the
    attributes only under ``perform_initialization`` (0.16, 0.17); 0.18+ build the model unchanged. Nothing
    upstream is changed either way."""
    import inspect

    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.core.tensor_parallel import layers

    from bridge_ext import patches
    from bridge_ext.patches.tensor_parallel import weight_attributes_only_with_initialization

    patches.apply("stack")
    needed = any(weight_attributes_only_with_initialization(name) for name in LAYERS)
    assert ("tp-weight-attributes-without-init" in patches.applied()) == needed
    provider = GPTModelProvider(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert ("tp-weight-attributes-without-init" in patches.register_hooks(provider)) == needed
    if needed:  # through Megatron Bridge's composed hook
        layer = _layer("RowParallelLinear", perform_initialization=False, use_cpu_initialization=True, group=tp_group)
        provider.pre_wrap_hook([layer])
        assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim) == (True, 1)
    for name in LAYERS:
        init = vars(getattr(layers, name))["__init__"]
        assert inspect.unwrap(init) is init, name  # upstream's own __init__
