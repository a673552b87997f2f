"""The streaming conversion (bridge_ext.convert.stream, ``nemo llm import`` / ``export``'s default) against the
model-building one (``--no-stream``: AutoBridge loads the HF weights into the built Megatron model and Megatron
Bridge saves it), on the tiny models of tests/hf_fixtures.py, bit for bit.

The second implementation is upstream's own path: Megatron Bridge's ``load_weights_hf_to_megatron``-style copy into
the model and ``save_megatron_model`` (import), megatron-core's loader into the model and
``stream_weights_megatron_to_hf`` (export). Compared: every tensor of the torch_dist checkpoint (global tensors,
read by torch's own DCP -> torch.save converter), the common state, ``run_config.yaml``; every exported safetensors
tensor, and the source's. The streamed checkpoint is also loaded by megatron-core into models split TP2 and EP2
(two processes, one torchrun launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import convert_rank_driver
from ckpt_io import assert_bit_identical, load_safetensors, load_torch_dist, read_global_tensors
import hf_fixtures
import parallel_driver
from bridge_ext.convert import export_hf, import_hf


def moonlight_proxy_dir(out: Path, *, shard_bytes: int) -> Path:
    """Random weights in the shipped Moonlight proxy config (DeepSeek-V3: MLA without a query low-rank, shared
    experts, a dense first layer)."""
    from recipes.models import MODELS as SPECS

    raw = json.loads((SPECS["moonlight_proxy"].config_dir / "config.json").read_text())
    return hf_fixtures.write_hf_dir(out, raw, dtype=raw["torch_dtype"], config_json=raw, seed=3, shard_bytes=shard_bytes)


MODELS = {  # name -> (builder, kwargs): the released layout, transformers 5's fused experts, an fp8 release
    "qwen3": (hf_fixtures.qwen3_dir, {}),
    "qwen3_tied": (hf_fixtures.qwen3_tied_dir, {}),
    "qwen3_moe": (hf_fixtures.qwen3_moe_dir, {}),
    "qwen3_moe_fused": (hf_fixtures.qwen3_moe_dir, {"expert_layout": "fused"}),
    "kimi_k2": (hf_fixtures.kimi_k2_dir, {}),
    "kimi_k2_fp8": (hf_fixtures.kimi_k2_fp8_dir, {"block": (16, 16)}),
    "moonlight": (moonlight_proxy_dir, {}),
}


def run_config(root: Path) -> list[str]:
    """run_config.yaml without the save path (each conversion stages into its own directory)."""
    text = (root / "iter_0000000" / "run_config.yaml").read_text()
    return [line for line in text.splitlines() if not line.strip().startswith("save:")]


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    """Per model: the HF source, its streamed and model-built imports, and both exports of the streamed one."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            build, kwargs = MODELS[name]
            root = tmp_path_factory.mktemp(name)
            hf = build(root / "hf", shard_bytes=100_000, **kwargs)
            quiet = dict(progress=False, console=None)
            streamed = import_hf(hf, root / "mg_stream", **quiet)
            import_hf(hf, root / "mg_model", stream=False, **quiet)
            export_hf(root / "mg_stream", root / "hf_stream", **quiet)
            export_hf(root / "mg_stream", root / "hf_model", stream=False, **quiet)
            cache[name] = dict(root=root, hf=hf, streamed=streamed)
        return cache[name]

    return get


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_streamed_import_equals_the_model_built_checkpoint(both_ways, name, tmp_path):
    run = both_ways(name)
    root = run["root"]
    assert run["streamed"].notes == [] or all("converted through" not in n for n in run["streamed"].notes)
    streamed = load_torch_dist(root / "mg_stream" / "iter_0000000", tmp_path)
    built = load_torch_dist(root / "mg_model" / "iter_0000000", tmp_path)
    assert any(".experts." in k for k in built) == (name not in ("qwen3", "qwen3_tied"))  # the dense ones
    assert_bit_identical(streamed, built, name)
    assert run_config(root / "mg_stream") == run_config(root / "mg_model")
    for side in ("config.json", "conversion.json"):
        assert (root / "mg_stream" / "hf_source" / side).read_bytes() == (root / "mg_model" / "hf_source" / side).read_bytes()
    common = root / "mg_stream" / "iter_0000000" / "common.pt"  # megatron-core < 0.19 (0.19: common_state above)
    if common.exists():
        import torch

        assert torch.load(common, weights_only=False) == torch.load(
            root / "mg_model" / "iter_0000000" / "common.pt", weights_only=False)
    names = {p.name for p in (root / "mg_model").rglob("*") if p.suffix != ".distcp"}
    assert {p.name for p in (root / "mg_stream").rglob("*") if p.suffix != ".distcp"} == names


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_streamed_export_equals_the_model_built_export_and_the_source(both_ways, name):
    run = both_ways(name)
    root = run["root"]
    streamed, built = load_safetensors(root / "hf_stream"), load_safetensors(root / "hf_model")
    assert_bit_identical(streamed, built, name)
    if name != "kimi_k2_fp8":  # fp8 weights come back dequantized (test_convert checks the values)
        source = load_safetensors(run["hf"])
        if name == "qwen3_moe_fused":  # exported per expert, as released checkpoints hold them
            from bridge_ext.hf.expert_layout import fused_shapes

            assert sorted(fused_shapes({k: tuple(v.shape) for k, v in streamed.items()})) == sorted(source)
        else:
            assert_bit_identical(streamed, source, name)
    for file in ("config.json", "model.safetensors.index.json"):
        assert (root / "hf_stream" / file).read_bytes() == (root / "hf_model" / file).read_bytes()


@pytest.mark.slow
def test_a_parameter_that_needs_the_model_falls_back_with_a_note(tmp_path, monkeypatch):
    """Where the skeleton cannot convert (here: told so), the import goes through the built model, says why, and
    writes the same checkpoint."""
    from bridge_ext.convert.stream import NeedsModel, importer

    def refuse(*args, **kwargs):
        raise NeedsModel("Megatron Bridge has no mapping for decoder.layers.0.mlp.linear_fc1.weight (1 parameters)")

    hf = hf_fixtures.qwen3_dir(tmp_path / "hf")
    monkeypatch.setattr(importer, "build_skeleton", refuse)
    summary = import_hf(hf, tmp_path / "mg", progress=False, console=None)
    assert summary.notes == ["converted through the built model: Megatron Bridge has no mapping for "
                             "decoder.layers.0.mlp.linear_fc1.weight (1 parameters)"]
    assert (tmp_path / "mg" / "iter_0000000" / ".metadata").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mg.")]


def test_fused_expert_views_read_by_byte_range_equal_safetensors_slices(tmp_path):
    """The HF reader's per-expert views of a transformers-5 fused checkpoint are the fused tensor's rows."""
    import torch
    from safetensors import safe_open

    from bridge_ext.hf.directory import inspect_hf_dir
    from bridge_ext.convert.stream.hf_io import HFByteReader

    hf = hf_fixtures.qwen3_moe_dir(tmp_path / "fused", shard_bytes=100_000, expert_layout="fused")
    source = inspect_hf_dir(hf)
    reader = HFByteReader(source)
    try:
        assert source.expert_views and set(reader.names) >= set(source.expert_views)
        for name, view in source.expert_views.items():
            with safe_open(str(hf / source.tensors[view.fused].file), "pt") as handle:
                fused = handle.get_tensor(view.fused)
            rows = view.rows or (0, fused.shape[1])
            assert torch.equal(reader.read(name), fused[view.expert, rows[0]:rows[1]]), name
            assert reader.nbytes(name) == reader.read(name).numel() * fused.element_size()
    finally:
        reader.close()


@pytest.mark.slow
@pytest.mark.heavy
def test_streamed_checkpoints_load_in_tp2_and_ep2_layouts(tmp_path):
    """A checkpoint streamed by two processes equals the one-process one; megatron-core loads it into the Kimi K2
    proxy split TP2 and EP2 (``export --no-stream --tp 2`` / ``--ep 2``: the model-building export, two processes),
    and both give the source's tensors back; the streamed export of it too."""
    from recipes.models import HF_CONFIGS

    raw = json.loads((Path(HF_CONFIGS) / "kimi_k2_proxy" / "config.json").read_text())
    hf = hf_fixtures.write_hf_dir(tmp_path / "hf", raw, dtype=raw["torch_dtype"], config_json=raw, seed=5)
    import_hf(hf, tmp_path / "mg1", progress=False, console=None)
    commands = [f"llm import --hf {hf} --out {tmp_path / 'mg2'}",
                f"llm export --ckpt {tmp_path / 'mg2'} --out {tmp_path / 'hf_tp2'} --no-stream --tp 2",
                f"llm export --ckpt {tmp_path / 'mg2'} --out {tmp_path / 'hf_ep2'} --no-stream --ep 2",
                f"llm export --ckpt {tmp_path / 'mg2'} --out {tmp_path / 'hf_stream'}"]  # fmt: skip
    records, _ = convert_rank_driver.launch(commands, tmp_path)
    assert [[r["rc"] for r in ranks] for ranks in records] == [[0] * len(commands)] * 2
    assert sorted(p.name for p in (tmp_path / "mg2" / "iter_0000000").glob("__*.distcp"))[:2] == [
        "__0_0.distcp", "__0_1.distcp"] and (tmp_path / "mg2" / "iter_0000000" / "__1_0.distcp").exists()
    reference = load_torch_dist(tmp_path / "mg1" / "iter_0000000", tmp_path)
    assert_bit_identical(load_torch_dist(tmp_path / "mg2" / "iter_0000000", tmp_path), reference, "2 processes")
    source = load_safetensors(hf)
    for layout in ("tp2", "ep2", "stream"):
        assert_bit_identical(load_safetensors(tmp_path / f"hf_{layout}"), source, layout)


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.heavy
def test_streamed_checkpoint_trains_like_the_model_built_one_in_every_layout(nemo, tmp_path):
    """The Qwen3-MoE proxy's HF weights imported both ways; two Muon steps from each in 1 process (here) and in
    cpu-tp2, cpu-pp2 and cpu-ep2 (one 2-process launch): the same losses and the same saved weights and Muon
    state, bit for bit, layout by layout; and the losses are the source's, not a fresh model's (lr 0 keeps them)."""
    from recipes.models import HF_CONFIGS

    from bridge_ext.training import read_losses

    raw = json.loads((Path(HF_CONFIGS) / "qwen3_moe_proxy" / "config.json").read_text())
    hf = hf_fixtures.write_hf_dir(tmp_path / "hf", raw, dtype=raw["torch_dtype"], config_json=raw, seed=7)
    ckpt = {"stream": tmp_path / "mg_stream", "model": tmp_path / "mg_model"}
    import_hf(hf, ckpt["stream"], progress=False, console=None)
    import_hf(hf, ckpt["model"], stream=False, progress=False, console=None)

    def args(layout: str, way: str, *extra: str) -> list[str]:
        save = tmp_path / f"run-{layout}-{way}"
        return ["--recipe", "qwen3_moe_proxy_muon", f"layout={layout}", "train.train_iters=2",
                f"checkpoint.pretrained_checkpoint={ckpt[way]}", f"checkpoint.save={save}",
                "checkpoint.save_interval=2", "logger.log_interval=1", f"logger.tensorboard_dir={save}/tb",
                "optimizer.muon_fp32_matmul_prec=highest", *extra]  # fmt: skip

    for way in ckpt:
        done = nemo(["llm", "pretrain", *args("cpu", way)], cwd=tmp_path)
        assert done.code == 0, done.stderr[-3000:]
    assert f"successfully loaded checkpoint from {ckpt['model']}" in done.stdout + done.stderr
    layouts = ("cpu-tp2", "cpu-pp2", "cpu-ep2")
    out = parallel_driver.launch([args(layout, way) for layout in layouts for way in ckpt], tmp_path, nproc=2)
    print(out)
    fresh = nemo(["llm", "pretrain", *args("cpu", "stream")[:4], "train.train_iters=1",
                  f"checkpoint.save={tmp_path / 'fresh'}", f"logger.tensorboard_dir={tmp_path / 'fresh'}/tb"],
                 cwd=tmp_path)  # fmt: skip
    assert fresh.code == 0, fresh.stderr[-3000:]
    # control: a fresh model's first loss is another one (the runs above start from the imported weights)
    assert read_losses(tmp_path / "fresh" / "losses.jsonl")[1] != read_losses(tmp_path / "run-cpu-stream" / "losses.jsonl")[1]
    for layout in ("cpu", *layouts):
        runs = {way: tmp_path / f"run-{layout}-{way}" for way in ckpt}
        losses = {way: read_losses(run / "losses.jsonl") for way, run in runs.items()}
        assert sorted(losses["stream"]) == [1, 2] and losses["stream"] == losses["model"], (layout, losses)
        assert losses["stream"][2] != losses["stream"][1]  # it trained
        got, want = (read_global_tensors(run / "iter_0000002") for run in runs.values())
        assert any(k.startswith("optimizer.state.momentum_buffer.") for k in want), layout
        assert_bit_identical(got, want, layout)
