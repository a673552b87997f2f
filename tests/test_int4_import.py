"""Kimi-K2-Thinking's INT4 release (compressed-tensors ``pack-quantized``) imported into bf16 Megatron checkpoints,
checked the way the fp8 release import is (tests/test_convert.py): a quantizer written here from the format's
published description (compressed-tensors ``pack_quantized.py``: ``pack_to_int32``'s pseudocode and the
``weight_packed`` / ``weight_scale`` / ``weight_shape`` parameters; transformers' compressed-tensors docs: "int4 ...
weight-quantized packed into int32"), a tiny Kimi-K2-Thinking-shaped model whose bf16 weights int4 holds exactly,
every dequantized matrix compared with that bf16 source, both import paths, and logits against transformers run on
the unquantized source. Negative controls (wrong nibble order, wrong group size, contradicting ignore list) must be
caught.
"""

from __future__ import annotations

import json

import pytest

import hf_fixtures
from ckpt_io import bits_equal, load_safetensors, load_torch_dist
from bridge_ext.convert import export_hf, import_hf, inspect_hf_dir
from bridge_ext.errors import UserError

FP32_TOLERANCE = 1e-5  # tests/test_convert.py's bar for tiny models in fp32


def test_unpacking_follows_the_published_bit_layout():
    """``pack_to_int32``'s pseudocode: +8 to unsigned, the first value in the lowest 4 bits. [1, 2, -8, 7, 0, 0, 0, 0]
    -> nibbles 9, 10, 0, 15, 8, 8, 8, 8 -> 0x8888F0A9, typed in by hand; a 9th value starts a zero-padded word."""
    import torch

    from bridge_ext.hf.int4 import dequantize_int4, unpack_int4

    q = torch.tensor([[1, 2, -8, 7, 0, 0, 0, 0, 3]], dtype=torch.int8)
    word = 0x8888F0A9 - 2**32  # as int32
    assert hf_fixtures.pack_int4(q).tolist() == [[word, 3 + 8]]
    assert unpack_int4(torch.tensor([[word, 11]], dtype=torch.int32), 9).tolist() == q.tolist()
    # groups of 4 columns: scales 0.5, 0.25, 2 (by hand: 1*.5, 2*.5, -8*.5, 7*.5 | 0 x 4 | 3*2)
    scale = torch.tensor([[0.5, 0.25, 2.0]], dtype=torch.bfloat16)
    w = dequantize_int4(torch.tensor([[word, 11]], dtype=torch.int32), scale, (1, 9), 4, torch.bfloat16)
    assert w.tolist() == [[0.5, 1.0, -4.0, 3.5, 0.0, 0.0, 0.0, 0.0, 6.0]]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The int4 checkpoint, its bf16 twin (the values int4 holds exactly) and the imports of both."""
    root = tmp_path_factory.mktemp("kimi_k2_thinking")
    hf = hf_fixtures.kimi_k2_thinking_int4_dir(root / "hf", reference=root / "ref", shard_bytes=100_000)
    quiet = dict(progress=False, console=None)
    streamed = import_hf(hf, root / "mg_stream", verify=True, tolerance=FP32_TOLERANCE, **quiet)
    built = import_hf(hf, root / "mg_model", stream=False, **quiet)
    import_hf(root / "ref", root / "mg_ref", **quiet)
    return dict(root=root, hf=hf, ref=root / "ref", streamed=streamed, built=built)


@pytest.mark.stack
@pytest.mark.slow
def test_every_dequantized_matrix_equals_the_bf16_source(release):
    from bridge_ext.hf.read import HFTensorReader

    source = inspect_hf_dir(release["hf"])
    assert source.int4.group_size == 32 and source.dtype == "bfloat16" and source.expert_layout == "per_expert"
    # the release's set: every routed expert matrix, nothing else (2 layers, 1 MoE layer x 8 experts x 3)
    assert len(source.int4_weights) == 24
    assert all(".mlp.experts." in name and ".shared_experts." not in name for name in source.int4_weights)
    ref = load_safetensors(release["ref"])
    reader = HFTensorReader(source)
    assert sorted(reader.names()) == sorted(ref)  # the packed tensors stand for exactly the bf16 weights
    for name, tensor in ref.items():
        assert bits_equal(reader.read(name), tensor), name
    reader.close()


@pytest.mark.stack
@pytest.mark.slow
def test_streamed_and_model_built_imports_equal_the_bf16_sources_import(release, tmp_path):
    root = release["root"]
    assert release["streamed"].max_logit_diff <= FP32_TOLERANCE  # Megatron vs transformers on the read weights
    for summary in (release["streamed"], release["built"]):
        assert summary.notes == []  # every stored tensor, packed values, scales and shapes, was used
    want = load_torch_dist(root / "mg_ref" / "iter_0000000", tmp_path, tensors_only=True)
    assert any(".experts." in k for k in want)
    for path in ("mg_stream", "mg_model"):
        got = load_torch_dist(root / path / "iter_0000000", tmp_path, tensors_only=True)
        assert sorted(got) == sorted(want), path
        for key, value in want.items():
            assert bits_equal(got[key], value), (path, key)


@pytest.mark.stack
@pytest.mark.slow
def test_logits_equal_transformers_on_the_unquantized_source_and_export_is_plain_bf16(release):
    from bridge_ext.convert.verify import verify_logits

    root = release["root"]
    # transformers' own from_pretrained of the bf16 twin (no int4 code involved) vs the int4 import in Megatron
    assert verify_logits(release["ref"], root / "mg_stream" / "iter_0000000") <= FP32_TOLERANCE
    exported = export_hf(root / "mg_stream", root / "out", progress=False, console=None)
    assert any("dropped the source's compressed-tensors quantization_config" in n for n in exported.notes)
    out_cfg, src_cfg = (json.loads((d / "config.json").read_text()) for d in (root / "out", release["hf"]))
    assert src_cfg.pop("quantization_config")["format"] == "pack-quantized"
    assert out_cfg == src_cfg  # the rest unchanged: model_type kimi_k2, auto_map, YaRN, torch_dtype bfloat16
    got, want = load_safetensors(root / "out"), load_safetensors(release["ref"])
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert bits_equal(got[key], value), key


# ------------------------------------------------------------------------------------------------ negative controls
@pytest.mark.stack
@pytest.mark.slow
def test_wrong_nibble_order_gives_different_matrices(tmp_path):
    """Packed high nibble first (the reverse of the format): every dequantized matrix differs from the bf16 source,
    so a reader with the wrong order could not pass the test above."""
    from bridge_ext.hf.read import HFTensorReader

    hf = hf_fixtures.kimi_k2_thinking_int4_dir(tmp_path / "hf", reference=tmp_path / "ref", nibble_order="high_first")
    source = inspect_hf_dir(hf)
    ref = load_safetensors(tmp_path / "ref")
    reader = HFTensorReader(source)
    differing = [name for name in source.int4_weights if not bits_equal(reader.read(name), ref[name])]
    assert sorted(differing) == sorted(source.int4_weights)
    reader.close()


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("stated", [16, 64])
def test_a_group_size_other_than_the_scales_is_refused(tmp_path, stated):
    hf = hf_fixtures.kimi_k2_thinking_int4_dir(tmp_path / "hf", group_size=32, stated_group_size=stated)
    with pytest.raises(UserError) as info:
        inspect_hf_dir(hf)
    message = str(info.value)
    assert "\n" not in message and f"in groups of {stated}" in message and "mlp.experts." in message


@pytest.mark.stack
@pytest.mark.slow
def test_a_group_size_that_fits_the_shapes_but_not_the_scales_gives_different_matrices(tmp_path):
    """Where shapes alone could not tell (scales cut to the count a wrong group size implies), the values do:
    scales made per 16 columns, read as per 32, give another matrix."""
    import torch

    from bridge_ext.hf.int4 import dequantize_int4, unpack_int4

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 64, generator=generator)
    exact, q, scale16 = hf_fixtures.int4_representable(weight, 16, generator)
    packed = hf_fixtures.pack_int4(q)
    assert torch.equal(unpack_int4(packed, 64), q)
    assert torch.equal(dequantize_int4(packed, scale16, (8, 64), 16, torch.bfloat16), exact)
    # the first two of four scales stretched over 32 columns each: not the matrix
    assert not torch.equal(dequantize_int4(packed, scale16[:, :2], (8, 64), 32, torch.bfloat16), exact)


@pytest.mark.stack
@pytest.mark.slow
def test_an_ignore_list_naming_packed_modules_and_other_schemes_are_refused(tmp_path):
    hf = hf_fixtures.kimi_k2_thinking_int4_dir(tmp_path / "hf")
    raw = json.loads((hf / "config.json").read_text())
    quant = raw["quantization_config"]
    cases = [
        ({"ignore": [*quant["ignore"], "re:.*mlp\\.experts.*"]}, "ignores model.layers.1.mlp.experts."),
        ({"config_groups": {"group_0": {**quant["config_groups"]["group_0"],
                                        "weights": {**quant["config_groups"]["group_0"]["weights"],
                                                    "symmetric": False}}}}, "not supported"),
        ({"format": "float-quantized"}, "not supported"),
    ]
    for change, expected in cases:
        (hf / "config.json").write_text(json.dumps({**raw, "quantization_config": {**quant, **change}}))
        with pytest.raises(UserError) as info:
            inspect_hf_dir(hf)
        assert "\n" not in str(info.value) and expected in str(info.value), change
