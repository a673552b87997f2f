"""A model family is recipe data: what conversion accepts and how it loads a config follow
``recipes.families.FAMILIES`` (docs/architecture.md, "Where a change goes").

The flow-through test registers a family that exists nowhere in our code, Llama (``LlamaForCausalLM``:
transformers and Megatron Bridge both have it), only in that table, and converts a tiny random Llama
checkpoint both ways: transformers' logits are the independent reference, the exported tensors must equal
the source's bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import hf_fixtures
from bridge_ext.convert import export_hf, import_hf, inspect_hf_dir
from bridge_ext.hf.directory import architecture_of, config_from_dir
from bridge_ext.convert.megatron_ckpt import provider_fields
from bridge_ext.errors import UserError
from bridge_ext.hf import load_hf_config
from recipes.families import FAMILIES, ModelFamily
from recipes.models import MODELS
from recipes.params import count_params

# the tiny Qwen3 of tests/hf_fixtures.py as a Llama: no q/k norms, its head_dim implied, Llama's RoPE base
LLAMA_TINY = {key: value for key, value in hf_fixtures.QWEN3_TINY.items() if key not in ("head_dim", "attention_bias")}
LLAMA_TINY.update(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10_000.0)
LLAMA = ModelFamily(model_type="llama", display="Llama", hf_architecture="LlamaForCausalLM",
                    source="a family registered by this test only")


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def one_line_error(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and message
    return message


@pytest.mark.once
def test_every_model_spec_is_a_family_that_conversion_accepts():
    """Each shipped model's ``family`` is its config.json's ``model_type``, a family with its HF class, and the
    run-recognition fields of its architecture (``provider_fields``) tell it apart from every other model."""
    for spec in MODELS.values():
        family = FAMILIES[spec.family]
        assert spec.hf_config["model_type"] == family.model_type, spec.name
        assert family.hf_architecture in spec.hf_config["architectures"], spec.name
        _, found, _ = config_from_dir(spec.config_dir)
        assert found is family
    fields = {spec.name: provider_fields(spec.architecture) for spec in MODELS.values()}
    for name, own in fields.items():
        assert [other for other, theirs in fields.items() if theirs == own] == [name]


@pytest.mark.once
def test_conversion_accepts_what_the_family_table_says(tmp_path, monkeypatch):
    llama = write_config(tmp_path / "llama", LLAMA_TINY)
    message = one_line_error(config_from_dir, llama)
    assert message.startswith("unsupported architecture LlamaForCausalLM") and "Qwen3ForCausalLM" in message
    # a model_type that is not a family of the HF class it names: refused before transformers is asked
    odd = write_config(tmp_path / "odd", dict(LLAMA_TINY, architectures=["Qwen3ForCausalLM"]))
    assert "model_type 'llama' is not supported (model_types of Qwen3ForCausalLM: qwen3)" in one_line_error(
        config_from_dir, odd)

    monkeypatch.setitem(FAMILIES, "llama", LLAMA)
    config, family, raw = config_from_dir(llama)
    assert family is LLAMA and type(config).__name__ == "LlamaConfig" and raw == LLAMA_TINY
    # A family whose config.json names remote code under its own model_type is built as transformers' type.
    monkeypatch.setitem(FAMILIES, "my_llama", ModelFamily(model_type="my_llama", display="My Llama",
                                                          hf_architecture="LlamaForCausalLM",
                                                          transformers_model_type="llama"))
    remote = dict(LLAMA_TINY, model_type="my_llama", auto_map={"AutoConfig": "configuration_my_llama.MyConfig"})
    config = load_hf_config(write_config(tmp_path / "my_llama", remote))
    assert type(config).__name__ == "LlamaConfig" and config.num_key_value_heads == 2
    assert not hasattr(config, "auto_map")  # never pointed at the remote code


@pytest.mark.stack  # Megatron Bridge's Llama bridge converts; it differs between releases
@pytest.mark.slow
def test_a_family_registered_only_in_recipes_data_converts_both_ways(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from bridge_ext.convert.model import bridge_for, prepare_runtime

    monkeypatch.setitem(FAMILIES, "llama", LLAMA)
    hf = hf_fixtures.write_hf_dir(tmp_path / "hf", LLAMA_TINY, seed=3, shard_bytes=60_000)
    source = inspect_hf_dir(hf)  # every tensor of the architecture present, at its shape
    assert source.family is LLAMA and source.architecture == "LlamaForCausalLM"

    # The recipes' reading of the config agrees with transformers' model and with Megatron Bridge's provider.
    architecture = architecture_of(source.config, source.raw_config)
    assert count_params(architecture).total == sum(math.prod(info.shape) for info in source.tensors.values())
    prepare_runtime()
    provider = bridge_for(source.config).to_megatron_provider(load_weights=False)
    assert {k: getattr(provider, k) for k in provider_fields(architecture)} == provider_fields(architecture)

    said: list[str] = []
    imported = import_hf(hf, tmp_path / "mg", verify=True, tolerance=1e-5, progress=False, console=said.append)
    assert said[0].startswith(f"importing Llama from {hf}")
    assert imported.max_logit_diff is not None and imported.max_logit_diff <= 1e-5  # transformers vs Megatron
    export_hf(tmp_path / "mg", tmp_path / "out", progress=False, console=None)
    assert (tmp_path / "out" / "config.json").read_bytes() == (hf / "config.json").read_bytes()

    def tensors(directory: Path) -> dict:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    before, after = tensors(hf), tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name

