"""``nemo llm import`` / ``export`` (bridge_ext.convert) on tiny random HF models built with transformers.

Fast tests cover validation and safety (no Megatron model is built). Slow tests convert Qwen3, Qwen3-MoE and a
Kimi-K2-style DeepSeek-V3 (real Kimi config keys) HF -> Megatron -> HF and check bit-identical weights,
Megatron-vs-transformers logits in fp32, and that transformers reloads the export without remote code.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_fixtures
from ckpt_io import load_safetensors
from bridge_ext import convert
from bridge_ext.convert import export_hf, find_iteration, import_hf, inspect_hf_dir, read_safetensors_header
from bridge_ext.convert.model import bridge_for, prepare_runtime
from bridge_ext.convert.parallel import init_model_parallel, process_group
from bridge_ext.errors import UserError
from bridge_ext.hf import apply_config_stated_fields
from tests.nemo_cli import start_nemo

REPO = Path(__file__).resolve().parents[1]
FP32_TOLERANCE = 1e-5  # the bar for tiny models in fp32


# ------------------------------------------------------------------------------------------------- helpers
def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its sha256: inputs must come out of a conversion unchanged."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_nothing_written(target: Path) -> None:
    assert not target.exists()
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]
    assert leftovers == []


def expect_user_error(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


def tokens(vocab: int):
    import torch

    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(7))


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory) -> Path:
    return hf_fixtures.qwen3_dir(tmp_path_factory.mktemp("src") / "qwen3", shard_bytes=100_000)


@pytest.fixture
def qwen3_copy(qwen3_hf, tmp_path) -> Path:
    """A private copy a test may corrupt."""
    return Path(shutil.copytree(qwen3_hf, tmp_path / "hf"))


MODELS = {
    "qwen3": (hf_fixtures.qwen3_dir, {}),
    "qwen3_tied": (hf_fixtures.qwen3_tied_dir, {}),
    "qwen3_moe": (hf_fixtures.qwen3_moe_dir, {}),
    "kimi_k2": (hf_fixtures.kimi_k2_dir, {}),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """HF dir -> import (with --verify) -> export, once per model; what each step returned and wrote."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            build, kwargs = MODELS[name]
            root = tmp_path_factory.mktemp(name)
            hf = build(root / "hf", shard_bytes=100_000, **kwargs)
            before = snapshot(hf)
            imported = import_hf(hf, root / "mg", verify=True, tolerance=FP32_TOLERANCE, progress=False, console=None)
            after_import = snapshot(hf)
            ckpt_before = snapshot(root / "mg")
            exported = export_hf(root / "mg", root / "out", progress=False, console=None)
            cache[name] = dict(
                hf=hf, mg=root / "mg", out=root / "out", imported=imported, exported=exported,
                hf_unchanged=before == after_import, ckpt_unchanged=ckpt_before == snapshot(root / "mg"),
            )  # fmt: skip
        return cache[name]

    return get


# ------------------------------------------------------------------------------------------------- CLI wiring
def test_import_and_export_commands_with_defaults():
    from bridge_ext.commands import build_parser, hf_export, hf_import

    parser = build_parser()
    args = parser.parse_args(["llm", "import", "--hf", "a", "--out", "b", "--verify"])
    assert (args.func, args.hf, args.out, args.verify, args.overwrite) == (
        hf_import.run, Path("a"), Path("b"), True, False)  # fmt: skip
    assert args.tolerance == convert.VERIFY_TOLERANCE == 1e-3
    args = parser.parse_args(["llm", "export", "--ckpt", "c", "--out", "d", "--iteration", "20", "--shard-size",
                              "500MB"])
    assert (args.func, args.ckpt, args.iteration, args.shard_size, args.hf_config) == (
        hf_export.run, Path("c"), 20, 500_000_000, None)  # fmt: skip


def test_cli_bad_input_is_one_line_exit_2_before_torch_is_imported(tmp_path):
    # fast because validation comes before torch / Megatron are imported: checked by what was imported, not by a
    # wall-clock limit (timings belong in bench/, and CI machines are loaded)
    code = ("import sys\nfrom bridge_ext.commands import main\ntry:\n    code = main(sys.argv[1:])\n"
            "except SystemExit as stop:\n    code = stop.code\n"
            "print(code, 'torch' in sys.modules, any(m.startswith('megatron') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, "llm", "import", "--hf", str(tmp_path / "nope"), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "False", "False"], result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not exist" in lines[0], result.stderr
    assert_nothing_written(tmp_path / "out")


@pytest.mark.once
def test_convert_package_parts_import_without_cycles():
    """The parts of bridge_ext/convert/ form a DAG (tests/test_patches.py checks the package among bridge_ext's
    modules; the stream/ subpackage is one part) and none is a file over ~500 lines."""
    import ast

    package = REPO / "bridge_ext" / "convert"
    graph = {}
    for path in [*package.glob("*.py"), *package.glob("stream/*.py")]:
        assert len(path.read_text().splitlines()) <= 520, path.name
        part = "stream" if path.parent.name == "stream" else path.stem
        graph.setdefault(part, set()).update(
            node.module.split(".")[2]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bridge_ext.convert.")
        )
        graph[part].discard(part)
    assert graph["__init__"] >= {"cli", "hf_to_megatron", "megatron_to_hf"} and "__init__" not in set().union(*graph.values())

    def visit(node, trail):
        assert node not in trail, " -> ".join([*trail, node])
        for nxt in graph[node]:
            visit(nxt, (*trail, node))

    for module in graph:
        visit(module, ())


# ------------------------------------------------------------------------------------------------- validation
def test_inspect_reads_shards_dtypes_and_tensors(qwen3_hf):
    source = inspect_hf_dir(qwen3_hf)
    assert source.architecture == "Qwen3ForCausalLM" and source.dtype == "float32"
    assert len(source.files) > 1  # sharded with an index
    assert len(source.tensors) == 25  # embed, 2 x (4 attn + 2 qk-norm + 3 mlp + 2 norms), norm, lm_head
    assert source.tensors["model.embed_tokens.weight"].shape == (256, 64)
    assert source.total_bytes == sum(4 * math.prod(t.shape) for t in source.tensors.values())


def test_kimi_config_is_understood_without_remote_code(tmp_path):
    hf = hf_fixtures.kimi_k2_dir(tmp_path / "k2")
    raw = json.loads((hf / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and "auto_map" in raw  # the real keys, as shipped
    source = inspect_hf_dir(hf)
    assert source.config.model_type == "deepseek_v3" and source.dtype == "bfloat16"
    assert source.config.scoring_func == "sigmoid" and source.config.first_k_dense_replace == 1
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in source.tensors
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in source.tensors
    assert "model.layers.0.mlp.gate_proj.weight" in source.tensors  # dense first layer


def test_missing_dir(tmp_path):
    expect_user_error("does not exist", import_hf, tmp_path / "nope", tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_no_config_json(qwen3_copy, tmp_path):
    (qwen3_copy / "config.json").unlink()
    expect_user_error("has no config.json", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_config_json_not_json(qwen3_copy, tmp_path):
    (qwen3_copy / "config.json").write_text("{ not json")
    expect_user_error("is not valid JSON", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_unsupported_architecture(qwen3_copy, tmp_path):
    raw = json.loads((qwen3_copy / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (qwen3_copy / "config.json").write_text(json.dumps(raw))
    msg = expect_user_error("unsupported architecture LlamaForCausalLM", import_hf, qwen3_copy, tmp_path / "out")
    assert "Qwen3ForCausalLM" in msg  # says what is supported
    assert_nothing_written(tmp_path / "out")


def test_truncated_safetensors(qwen3_copy, tmp_path):
    shard = sorted(qwen3_copy.glob("*.safetensors"))[1]
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size - 100)
    expect_user_error(f"{shard.name} is truncated", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_corrupt_safetensors_header(qwen3_copy, tmp_path):
    shard = sorted(qwen3_copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[9:20] = b"\x00garbage!!\xff"
    shard.write_bytes(bytes(data))
    expect_user_error(f"{shard.name} is corrupt", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_missing_shard_listed_in_index(qwen3_copy, tmp_path):
    shard = sorted(qwen3_copy.glob("*.safetensors"))[-1]
    shard.unlink()
    expect_user_error(f"shard {shard.name} listed in model.safetensors.index.json is missing",
                      import_hf, qwen3_copy, tmp_path / "out")  # fmt: skip
    assert_nothing_written(tmp_path / "out")


def test_missing_tensor(qwen3_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    index_file = qwen3_copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    victim = "model.layers.1.mlp.down_proj.weight"
    shard = qwen3_copy / index["weight_map"].pop(victim)
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    expect_user_error(f"tensor {victim} is missing", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_shape_mismatch_with_config(qwen3_copy, tmp_path):
    raw = json.loads((qwen3_copy / "config.json").read_text())
    raw["intermediate_size"] = 96
    (qwen3_copy / "config.json").write_text(json.dumps(raw))
    expect_user_error(r"has shape \[128, 64\], config.json implies \[96, 64\]", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_dtype_mismatch_with_config(qwen3_copy, tmp_path):
    raw = json.loads((qwen3_copy / "config.json").read_text())
    raw["torch_dtype"] = "bfloat16"  # the weights are float32
    (qwen3_copy / "config.json").write_text(json.dumps(raw))
    expect_user_error("dtype mismatch .* is F32, config.json declares torch_dtype bfloat16",
                      import_hf, qwen3_copy, tmp_path / "out")  # fmt: skip
    assert_nothing_written(tmp_path / "out")


def test_dtype_mismatch_between_tensors(qwen3_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    raw = json.loads((qwen3_copy / "config.json").read_text())
    del raw["torch_dtype"]
    (qwen3_copy / "config.json").write_text(json.dumps(raw))
    shard = sorted(qwen3_copy.glob("*.safetensors"))[0]
    tensors = {k: v.half() for k, v in load_file(shard).items()}
    save_file(tensors, shard, metadata={"format": "pt"})
    expect_user_error("dtype mismatch .* is (F16|F32) but .* is (F32|F16)", import_hf, qwen3_copy, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_non_empty_target_refused_and_untouched(qwen3_hf, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    expect_user_error("not empty; pass --overwrite", import_hf, qwen3_hf, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and (target / "keep.txt").read_text() == "mine"


def test_target_inside_input_refused(qwen3_copy):
    before = snapshot(qwen3_copy)
    expect_user_error("overlaps the input", import_hf, qwen3_copy, qwen3_copy / "mg")
    assert snapshot(qwen3_copy) == before


def test_safetensors_header_reader_matches_safetensors(qwen3_hf):
    from safetensors import safe_open

    shard = sorted(qwen3_hf.glob("*.safetensors"))[0]
    infos = read_safetensors_header(shard)
    with safe_open(shard, "pt") as handle:
        assert sorted(handle.keys()) == sorted(infos)
        for key in handle.keys():
            assert tuple(handle.get_slice(key).get_shape()) == infos[key].shape


# ------------------------------------------------------------------------------------------------- checkpoints
def _fake_iteration(root: Path, number: int) -> Path:
    """An iteration directory whose save was interrupted after its data files (which iteration export picks is
    tested in tests/test_kill_safe.py)."""
    path = root / f"iter_{number:07d}"
    path.mkdir(parents=True)
    (path / "common.pt").write_bytes(b"x")
    return path


def test_export_bad_inputs_leave_nothing(qwen3_hf, tmp_path):
    out = tmp_path / "out"
    expect_user_error("does not exist", export_hf, tmp_path / "nope", out)
    expect_user_error("is not a Megatron checkpoint", export_hf, qwen3_hf, out)
    _fake_iteration(tmp_path / "ckpt", 3)
    expect_user_error("no tracker .* no iteration is complete either", export_hf, tmp_path / "ckpt", out)
    assert_nothing_written(out)


# ------------------------------------------------------------------------------------------------- conversions
@pytest.mark.stack  # conversion is Megatron Bridge's bridges: they differ between releases
@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_identical_and_logits_match(converted, name):
    import torch

    run = converted(name)
    assert run["hf_unchanged"] and run["ckpt_unchanged"]  # inputs are only read
    # Megatron (loaded from the written checkpoint) vs transformers, fp32, same tokens.
    assert run["imported"].max_logit_diff is not None and run["imported"].max_logit_diff <= FP32_TOLERANCE
    source, exported = load_safetensors(run["hf"]), load_safetensors(run["out"])
    assert sorted(source) == sorted(exported)
    for key, tensor in source.items():
        assert exported[key].dtype == tensor.dtype and exported[key].shape == tensor.shape, key
        assert exported[key].reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8)), key
    assert (run["out"] / "config.json").read_bytes() == (run["hf"] / "config.json").read_bytes()
    assert (run["out"] / "generation_config.json").is_file()
    index = json.loads((run["out"] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in source.values())
    assert run["exported"].tensors == len(source) and run["imported"].tensors == len(source)
    # The Megatron checkpoint is what recipes load with checkpoint.pretrained_checkpoint=...
    assert (run["mg"] / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert (run["mg"] / "iter_0000000" / ".metadata").is_file()
    assert (run["mg"] / convert.HF_SOURCE_DIR / "config.json").read_bytes() == (run["hf"] / "config.json").read_bytes()


@pytest.mark.slow
def test_tokenizer_travels_with_the_checkpoint(converted):
    from transformers import AutoTokenizer

    run = converted("qwen3")  # the Qwen3 fixture ships tokenizer.json + tokenizer_config.json
    assert (run["mg"] / convert.HF_SOURCE_DIR / "tokenizer.json").is_file()
    assert (run["mg"] / "iter_0000000" / "tokenizer").is_dir()  # Megatron Bridge's tokenizer assets for recipes
    files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    shipped = [f for f in files if (run["hf"] / f).is_file()]
    assert shipped[:2] == list(files[:2])  # transformers 5 writes no special_tokens_map.json
    for file in shipped:
        assert (run["out"] / file).read_bytes() == (run["hf"] / file).read_bytes(), file
    exported, source = AutoTokenizer.from_pretrained(run["out"]), AutoTokenizer.from_pretrained(run["hf"])
    assert exported("w5 w6 w200")["input_ids"] == source("w5 w6 w200")["input_ids"] == [5, 6, 200]
    assert not any("tokenizer" in note for note in run["exported"].notes)


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "qwen3_moe"])
def test_transformers_reloads_qwen_export_without_remote_code(converted, name):
    import torch
    from transformers import AutoModelForCausalLM

    run = converted(name)
    exported = AutoModelForCausalLM.from_pretrained(run["out"], dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(run["hf"], dtype=torch.float32)
    assert type(exported).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM"}.get(name, "Qwen3ForCausalLM")
    if name == "qwen3_tied":
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    ids = tokens(exported.config.vocab_size)
    with torch.no_grad():
        logits = exported(ids).logits
        # Same bytes, separate instances: the CPU kernels may block differently (1 ulp seen for MoE).
        assert (logits - original(ids).logits).abs().max() <= 1e-6
    assert logits.abs().max() > 0.1


@pytest.mark.stack
@pytest.mark.slow
def test_kimi_export_reproduces_config_and_loads_into_deepseek_v3(converted):
    import torch
    from transformers import DeepseekV3ForCausalLM

    from bridge_ext.hf import load_hf_config

    run = converted("kimi_k2")
    raw = json.loads((run["out"] / "config.json").read_text())
    assert raw == json.loads((run["hf"] / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and raw["auto_map"]["AutoModelForCausalLM"].startswith("modeling_deepseek")
    model, original = (
        DeepseekV3ForCausalLM.from_pretrained(d, config=load_hf_config(d), dtype=torch.float32)
        for d in (run["out"], run["hf"])
    )
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        logits = model(ids).logits
        assert (logits - original(ids).logits).abs().max() <= 1e-6
    assert logits.abs().max() > 0.1  # real values, not an all-zero model


@pytest.mark.stack
@pytest.mark.slow
def test_kimi_fp8_release_format_imports_dequantized(tmp_path):
    """Kimi-K2-Instruct ships fp8 (e4m3) linear weights with 128x128 block scales; import dequantizes them."""
    import torch
    from safetensors import safe_open

    hf = hf_fixtures.kimi_k2_fp8_dir(tmp_path / "hf", block=(16, 16))
    source = inspect_hf_dir(hf)
    assert source.fp8 and source.fp8_block == (16, 16)
    imported = import_hf(hf, tmp_path / "mg", verify=True, tolerance=FP32_TOLERANCE, progress=False, console=None)
    assert imported.max_logit_diff <= FP32_TOLERANCE  # vs transformers on the same dequantized weights
    assert imported.notes == []  # every tensor, scales included, was used
    exported = export_hf(tmp_path / "mg", tmp_path / "out", progress=False, console=None)
    assert any("dropped the source's fp8 quantization_config" in n for n in exported.notes)
    out_cfg, src_cfg = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", hf))
    src_cfg.pop("quantization_config")
    assert out_cfg == src_cfg  # everything else unchanged: model_type kimi_k2, auto_map, torch_dtype bfloat16
    weights = load_safetensors(tmp_path / "out")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    scale = f"{name}_scale_inv"
    with safe_open(hf / source.tensors[name].file, "pt") as a, safe_open(hf / source.tensors[scale].file, "pt") as b:
        expected = convert.dequantize_fp8(a.get_tensor(name), b.get_tensor(scale), (16, 16))
    assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], expected)
    assert not any(k.endswith("_scale_inv") for k in weights)
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16  # as in the source


def test_fp8_dequantization_matches_block_layout():
    import torch

    weight = torch.randn(40, 24)
    q, scale = hf_fixtures.quantize_fp8(weight, (16, 16))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)  # ceil(40/16) x ceil(24/16)
    restored = convert.dequantize_fp8(q, scale, (16, 16)).float()
    assert (restored - weight).abs().max() <= 0.07 * weight.abs().max()  # e4m3: 3 mantissa bits
    per_element = scale.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :24]
    assert torch.equal(convert.dequantize_fp8(q, scale, (16, 16)), (q.float() * per_element).bfloat16())


# ------------------------------------------------------------------------------------------------- expert layouts
# Released checkpoints store routed experts one tensor each; transformers 5's models fuse them
# (mlp.experts.gate_up_proj [E, 2I, H]: expert N's gate rows then its up rows; mlp.experts.down_proj [E, H, I])
# and its save_pretrained(save_original_format=False) writes them so. Under transformers 4 the fused fixture is
# stacked by tests/hf_fixtures.py; under 5 transformers writes it.
def test_expert_layout_names_and_shapes():
    from bridge_ext.hf.expert_layout import expert_layout, fused_shapes, per_expert_shapes, per_expert_views

    fused = {"model.layers.0.mlp.gate.weight": (2, 8), "model.layers.0.mlp.experts.gate_up_proj": (2, 6, 8),
             "model.layers.0.mlp.experts.down_proj": (2, 8, 3), "model.norm.weight": (8,)}
    released = {"model.layers.0.mlp.gate.weight": (2, 8),
                **{f"model.layers.0.mlp.experts.{n}.{p}.weight": s for n in (0, 1)
                   for p, s in (("gate_proj", (3, 8)), ("up_proj", (3, 8)), ("down_proj", (8, 3)))},
                "model.norm.weight": (8,)}  # fmt: skip
    assert list(per_expert_shapes(fused).items()) == list(released.items())  # transformers 4's order
    assert fused_shapes(released) == fused and per_expert_shapes(released) == released
    views = per_expert_views(fused)
    up = views["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert up == ("model.layers.0.mlp.experts.gate_up_proj", 1, (3, 6))
    assert views["model.layers.0.mlp.experts.0.down_proj.weight"] == ("model.layers.0.mlp.experts.down_proj", 0, None)
    assert (expert_layout(fused), expert_layout(released), expert_layout(["model.norm.weight"])) == (
        "fused", "per_expert", "none")  # fmt: skip
    with pytest.raises(ValueError, match="mixes fused"):
        expert_layout([*fused, *released])


def test_fused_and_per_expert_checkpoints_hold_the_same_experts(tmp_path):
    import torch

    from bridge_ext.hf.read import HFTensorReader

    released = hf_fixtures.qwen3_moe_dir(tmp_path / "released", shard_bytes=100_000)
    fused = hf_fixtures.qwen3_moe_dir(tmp_path / "fused", shard_bytes=100_000, expert_layout="fused")
    a, b = inspect_hf_dir(released), inspect_hf_dir(fused)
    assert (a.expert_layout, b.expert_layout) == ("per_expert", "fused")
    assert len(a.tensors) == 45  # embed, norm, lm_head + 2 x (4 attn + 2 qk-norm + 2 norms + router + 4 experts x 3)
    assert len(b.tensors) == 25  # each layer's 12 expert tensors are 2 fused ones
    per, whole = load_safetensors(released), load_safetensors(fused)
    gate_up, down = whole["model.layers.1.mlp.experts.gate_up_proj"], whole["model.layers.1.mlp.experts.down_proj"]
    assert gate_up.shape == (4, 64, 64) and down.shape == (4, 64, 32)  # [E, 2 x 32, 64], [E, 64, 32]
    assert torch.equal(gate_up[2, :32], per["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(gate_up[2, 32:], per["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(down[3], per["model.layers.1.mlp.experts.3.down_proj.weight"])
    reader = HFTensorReader(b)  # what conversion reads: the released names, one expert's rows at a time
    assert sorted(reader.names()) == sorted(per)
    assert all(torch.equal(reader.read(name), tensor) for name, tensor in per.items())


def test_fused_checkpoint_problems_are_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    fused = hf_fixtures.qwen3_moe_dir(tmp_path / "fused", shard_bytes=100_000, expert_layout="fused")
    bad = Path(shutil.copytree(fused, tmp_path / "bad_shape"))
    raw = json.loads((bad / "config.json").read_text())
    raw["moe_intermediate_size"] = 24
    (bad / "config.json").write_text(json.dumps(raw))
    expect_user_error(r"gate_up_proj has shape \[4, 64, 64\], config.json implies \[4, 48, 64\]",
                      import_hf, bad, tmp_path / "out")  # fmt: skip
    mixed = Path(shutil.copytree(fused, tmp_path / "mixed"))
    index_file = mixed / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = mixed / index["weight_map"]["model.layers.0.mlp.experts.gate_up_proj"]
    tensors = load_file(shard)
    extra = "model.layers.0.mlp.experts.0.gate_proj.weight"
    tensors[extra] = tensors["model.layers.0.mlp.experts.gate_up_proj"][0, :32].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][extra] = shard.name
    index_file.write_text(json.dumps(index))
    expect_user_error(r"mixes fused \(model.layers.0.mlp.experts.gate_up_proj\) and per-expert \(" + extra,
                      import_hf, mixed, tmp_path / "out")  # fmt: skip
    assert_nothing_written(tmp_path / "out")


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "kimi_k2"])
def test_fused_checkpoint_imports_like_the_released_one_and_exports_per_expert(converted, name, tmp_path):
    """A fused checkpoint (same seed as ``converted``'s released one): import verifies against transformers and
    writes the same Megatron tensors as the released layout's import; export writes the released layout, bit for
    bit (what transformers 4 and 5 and serving stacks load)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = converted(name)
    build, _ = MODELS[name]
    hf = build(tmp_path / "hf", shard_bytes=100_000, expert_layout="fused")
    source = inspect_hf_dir(hf)
    assert source.expert_layout == "fused"
    imported = import_hf(hf, tmp_path / "mg", verify=True, tolerance=FP32_TOLERANCE, progress=False, console=None)
    assert imported.max_logit_diff <= FP32_TOLERANCE
    assert imported.tensors == len(source.tensors) and imported.notes == []  # every fused tensor was read
    checkpoints = []
    for mg in (tmp_path / "mg", run["mg"]):
        dcp_to_torch_save(str(mg / "iter_0000000"), str(tmp_path / "state.pt"))
        state = torch.load(tmp_path / "state.pt", weights_only=False)
        checkpoints.append({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    assert sorted(checkpoints[0]) == sorted(checkpoints[1]) and any(".experts." in k for k in checkpoints[0])
    assert all(torch.equal(checkpoints[0][k], v) for k, v in checkpoints[1].items())
    exported = export_hf(tmp_path / "mg", tmp_path / "out", progress=False, console=None)
    out, released = load_safetensors(tmp_path / "out"), load_safetensors(run["hf"])
    assert sorted(out) == sorted(released) and exported.tensors == len(released)
    for key, tensor in released.items():
        assert out[key].dtype == tensor.dtype and out[key].reshape(-1).view(torch.uint8).equal(
            tensor.reshape(-1).view(torch.uint8)), key
    assert (tmp_path / "out" / "config.json").read_bytes() == (hf / "config.json").read_bytes()


@pytest.mark.stack
def test_kimi_k2_converts_with_megatron_bridges_own_bridge_where_it_has_one():
    """megatron-bridge >= 0.4 has ``KimiK2Bridge`` (model_type kimi_k2): conversion uses it; 0.3 has none and
    Kimi K2 (``architectures: DeepseekV3ForCausalLM``) converts with the DeepSeek-V3 bridge. Either way the
    fields the config states win (YaRN betas, aux-loss coefficient, router scoring)."""
    import megatron.bridge.models as models
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    from bridge_ext.hf import load_hf_config, upstream_bridge_for_model_type

    own = getattr(models, "KimiK2Bridge", None)
    assert upstream_bridge_for_model_type("kimi_k2") is own
    assert upstream_bridge_for_model_type("deepseek_v3") is None  # transformers' own model_type: as it is
    prepare_runtime()
    config = load_hf_config(hf_fixtures.KIMI_K2_CONFIG)
    bridge = bridge_for(config, model_type="kimi_k2")
    assert type(bridge._model_bridge) is (own or DeepSeekV3Bridge)
    assert type(bridge_for(config)._model_bridge) is DeepSeekV3Bridge  # no model_type: by architecture
    provider = bridge.to_megatron_provider(load_weights=False)
    apply_config_stated_fields(provider, config)
    assert (provider.beta_fast, provider.beta_slow, provider.rotary_scaling_factor) == (1.0, 1.0, 32.0)
    assert provider.moe_aux_loss_coeff == 0.001 and provider.moe_router_score_function == "sigmoid"
    assert provider.moe_router_topk_scaling_factor == 2.827 and provider.num_moe_experts == 384
    assert config.architectures == ["DeepseekV3ForCausalLM"] and getattr(config, "auto_map", None) is None


@pytest.mark.slow
def test_verify_detects_a_wrong_model(converted, tmp_path):
    run = converted("qwen3")
    other = hf_fixtures.qwen3_dir(tmp_path / "other", seed=1)  # same architecture, different weights
    iter_dir, _ = find_iteration(run["mg"])
    assert convert.verify_logits(other, iter_dir) > 1e-2


@pytest.mark.slow
def test_failed_verification_leaves_nothing(converted, tmp_path):
    run = converted("kimi_k2")
    assert run["imported"].max_logit_diff > 0  # MLA + MoE: not bit-equal, so a zero tolerance must fail
    expect_user_error("verification failed", import_hf, run["hf"], tmp_path / "mg", verify=True, tolerance=0.0,
                      progress=False, console=None)  # fmt: skip
    assert_nothing_written(tmp_path / "mg")


@pytest.mark.slow
def test_overwrite_replaces_target(converted, tmp_path):
    run = converted("qwen3")
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    summary = export_hf(run["mg"], target, overwrite=True, progress=False, console=None)
    assert not (target / "stale.txt").exists() and (target / "config.json").is_file()
    assert summary.tensors == 25 and summary.bytes == sum(t.numel() * 4 for t in load_safetensors(run["hf"]).values())
    assert "tensors" in summary.line() and "/s" in summary.line()


@pytest.mark.slow
def test_export_without_known_hf_config_asks_for_one(converted, tmp_path):
    run = converted("qwen3")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["mg"] / "iter_0000000", ckpt / "iter_0000007")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")  # as a finished save leaves it
    run_config = ckpt / "iter_0000007" / "run_config.yaml"
    run_config.write_text(run_config.read_text().replace(str(run["hf"].absolute()), "/gone/qwen3"))
    shutil.rmtree(ckpt / "iter_0000007" / ".integrity")  # a checkpoint written without this package's record
    expect_user_error("pass --hf-config DIR", export_hf, ckpt, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")
    summary = export_hf(ckpt, tmp_path / "out", hf_config=run["hf"], progress=False, console=None)
    assert summary.tensors == 25
    exported, source = load_safetensors(tmp_path / "out"), load_safetensors(run["hf"])
    assert all(exported[k].equal(v) for k, v in source.items())


@pytest.mark.slow
def test_export_with_mismatched_hf_config_is_a_user_error(converted, tmp_path):
    run = converted("qwen3")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    raw = dict(hf_fixtures.QWEN3_TINY, hidden_size=96, torch_dtype="float32")
    (wrong / "config.json").write_text(json.dumps(raw))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["mg"] / "iter_0000000", ckpt / "iter_0000001")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")  # as a finished save leaves it
    expect_user_error("does not match the model", export_hf, ckpt, tmp_path / "out", hf_config=wrong)
    assert_nothing_written(tmp_path / "out")


def make_training_run(hf: Path, save: Path, *, iterations: tuple[int, ...] = (3, 5)) -> dict:
    """A Megatron Bridge training checkpoint as a run writes it: Adam state, RNG state, several iterations.

    Starts from ``hf``'s weights (Megatron Bridge's pre-wrap hook), trains with Megatron's real DDP + Adam on
    a fixed batch and saves with Megatron Bridge's ``save_checkpoint`` (run_config.yaml records
    ``model.hf_model_id``). Returns the in-memory weights, in HF names, after the last iteration.
    """
    import torch
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
    from megatron.bridge.training.checkpointing import save_checkpoint
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig, OptimizerConfig
    from megatron.bridge.training.state import GlobalState
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from bridge_ext.cpu import configure_for_cpu

    cpu = prepare_runtime()
    source = inspect_hf_dir(hf)
    with process_group(cpu):
        pretrained = PreTrainedCausalLM(model_name_or_path=str(hf), torch_dtype=torch.float32)
        pretrained.config = source.config
        bridge = bridge_for(source.config, pretrained)
        provider = bridge.to_megatron_provider(load_weights=True)
        apply_config_stated_fields(provider, source.config)  # as the product does (head_dim on MB 0.3.0)
        configure_for_cpu(provider)
        provider.finalize()
        init_model_parallel(tp=1, pp=1, ep=1, cpu=cpu)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=False)
        model = provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=True, use_cpu_initialization=True)
        opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=False, fp16=False, use_distributed_optimizer=False,
                                  weight_decay=0.0, clip_grad=1.0)  # fmt: skip
        opt_cfg.finalize()
        optimizer = get_megatron_optimizer(opt_cfg, model)
        state = GlobalState()
        state.cfg = ConfigContainer(
            model=provider, train=None, optimizer=opt_cfg, ddp=ddp, scheduler=None, dataset=None,
            logger=LoggerConfig(), tokenizer=None, dist=None,
            checkpoint=CheckpointConfig(save=str(save), async_save=False, save_optim=True, save_rng=True,
                                        ckpt_format="torch_dist"),
        )  # fmt: skip
        ids = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(16).unsqueeze(0).expand(2, -1)
        losses = []
        for iteration in range(1, max(iterations) + 1):
            model[0].zero_grad_buffer()
            optimizer.zero_grad()
            loss = model[0](input_ids=ids, position_ids=pos, attention_mask=None, labels=ids).float().mean()
            loss.backward()
            model[0].finish_grad_sync()
            assert optimizer.step()[0]
            losses.append(float(loss))
            if iteration in iterations:
                state.train_state.step = iteration
                save_checkpoint(state, model, optimizer, None, num_floating_point_operations_so_far=0)
        final = {name: t.clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    return {"losses": losses, "final": final}


@pytest.fixture(scope="module")
def training_run(qwen3_hf, tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("run")
    return dict(make_training_run(qwen3_hf, run / "ckpt"), ckpt=run / "ckpt", root=run)


@pytest.mark.stack
@pytest.mark.slow
def test_export_of_a_training_run_latest_and_chosen_iteration(training_run, qwen3_hf):
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    ckpt, root = training_run["ckpt"], training_run["root"]
    assert training_run["losses"][-1] < training_run["losses"][0]  # it trained
    metadata = FileSystemReader(str(ckpt / "iter_0000005")).read_metadata()
    assert any(k.startswith("optimizer.state.exp_avg") for k in metadata.state_dict_metadata)  # Adam state present
    before = snapshot(ckpt)
    latest = export_hf(ckpt, root / "latest", progress=False, console=None)  # config via run_config's hf_model_id
    chosen = export_hf(ckpt, root / "it3", iteration=3, progress=False, console=None)
    assert snapshot(ckpt) == before
    assert latest.tensors == chosen.tensors == 25
    w5, w3, w0 = load_safetensors(root / "latest"), load_safetensors(root / "it3"), load_safetensors(qwen3_hf)
    assert sorted(w5) == sorted(training_run["final"])
    assert all(torch.equal(w5[k], training_run["final"][k]) for k in w5)  # exactly the trained weights
    assert not torch.equal(w3["model.layers.0.mlp.up_proj.weight"], w5["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(w0["model.layers.0.mlp.up_proj.weight"], w3["model.layers.0.mlp.up_proj.weight"])
    model = AutoModelForCausalLM.from_pretrained(root / "latest", dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (root / "latest" / "config.json").read_bytes() == (qwen3_hf / "config.json").read_bytes()


@pytest.mark.slow
def test_import_pretrain_export_cycle_with_a_recipe(nemo, tmp_path):
    """HF -> import -> `nemo llm pretrain --recipe kimi_k2_proxy_muon checkpoint.pretrained_checkpoint=...`
    (Muon, CPU, lr 0, expert-bias updates off) -> export with no hints -> the same HF weights, bit for bit.

    Shows that recipes load what import writes, that a training run's checkpoint (Muon state present)
    exports, and that the run's shipped config is recognized without --hf-config.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import DeepseekV3ForCausalLM

    from bridge_ext.hf import load_hf_config
    from recipes.models import HF_CONFIGS

    shipped = Path(HF_CONFIGS) / "kimi_k2_proxy" / "config.json"
    raw = json.loads(shipped.read_text())
    hf = hf_fixtures.write_hf_dir(tmp_path / "hf", raw, dtype=raw["torch_dtype"], config_json=raw, seed=5)
    import_hf(hf, tmp_path / "mg", progress=False, console=None)
    result = nemo(
        ["llm", "pretrain", "--recipe", "kimi_k2_proxy_muon", "train.train_iters=2",
         # lr 0 freezes the weights; the expert-score bias moves at its own rate (aux-loss-free balancing)
         "optimizer.lr=0", "optimizer.min_lr=0", "model.moe_router_bias_update_rate=0",
         f"checkpoint.pretrained_checkpoint={tmp_path / 'mg'}",
         f"checkpoint.save={tmp_path / 'run'}", "checkpoint.save_interval=2"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.code == 0, result.stderr[-3000:]
    assert f"successfully loaded checkpoint from {tmp_path / 'mg'}" in result.stdout + result.stderr
    iter_dir, number = find_iteration(tmp_path / "run")
    assert number == 2
    metadata = FileSystemReader(str(iter_dir)).read_metadata()
    assert any(k.startswith("optimizer.") for k in metadata.state_dict_metadata)  # Muon state is in there
    summary = export_hf(tmp_path / "run", tmp_path / "out", progress=False, console=None)
    assert (tmp_path / "out" / "config.json").read_bytes() == shipped.read_bytes()  # found by its sizes
    source, exported = load_safetensors(hf), load_safetensors(tmp_path / "out")
    assert sorted(source) == sorted(exported) and summary.tensors == len(source)
    assert all(exported[k].equal(v) for k, v in source.items())
    assert convert.verify_logits(tmp_path / "out", iter_dir) <= FP32_TOLERANCE
    model = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", config=load_hf_config(tmp_path / "out"))
    assert model.config.n_routed_experts == raw["n_routed_experts"]


@pytest.mark.slow
def test_sigterm_during_import_leaves_nothing(qwen3_hf, tmp_path):
    import signal
    import time

    target = tmp_path / "out"
    proc = start_nemo(["llm", "import", "--hf", qwen3_hf, "--out", target], stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "import ended before its staging directory appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0, stderr[-2000:]
    assert_nothing_written(target)


def _shard_lines_match(lines: list[str], hf_dir: Path, verb: str) -> None:
    """The lines before the summary: one per safetensors file of ``hf_dir``, its tensors and bytes as the
    safetensors library reads that file."""
    import re

    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    assert len(files) > 1 and len(lines) > len(files), (files, lines)
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    for file, line in zip(files, lines[-1 - len(files):-1], strict=True):
        match = re.fullmatch(rf"  {re.escape(file.name)}: (\d+) tensors, ([\d.]+) (B|KB|MB|GB) {verb}", line)
        assert match, (file.name, line)
        with safe_open(str(file), framework="pt") as shard:
            tensors = [shard.get_tensor(key) for key in shard.keys()]
        assert int(match[1]) == len(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert float(match[2]) * scale[match[3]] == pytest.approx(nbytes, abs=0.005 * scale[match[3]]), line


@pytest.mark.slow
def test_cli_import_verify_and_export(nemo, qwen3_hf, tmp_path):
    result = nemo(["llm", "import", "--hf", qwen3_hf, "--out", tmp_path / "mg", "--verify"])
    assert result.code == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("import: 25 tensors") and "verified: max |logit diff|" in lines[-1], result.stdout
    _shard_lines_match(lines, qwen3_hf, "read")  # the source has shards of 100 kB
    result = nemo(["llm", "export", "--ckpt", tmp_path / "mg", "--out", tmp_path / "hf", "--shard-size", "150KB"])
    assert result.code == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("export: 25 tensors")
    _shard_lines_match(lines, tmp_path / "hf", "written")
    assert all(load_safetensors(tmp_path / "hf")[k].equal(v) for k, v in load_safetensors(qwen3_hf).items())
