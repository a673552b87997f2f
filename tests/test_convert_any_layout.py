"""Streaming export of checkpoints that training saved in another layout (issue 29): a torch_dist checkpoint
written by TP2, TP2 x EP2 or DP2 ranks stores each tensor as those ranks' chunks; ``nemo llm export`` on one
process reads each parameter from whichever stored chunks overlap it.

The second implementation is megatron-core's own loader (``--no-stream``: the checkpoint loaded into the built
model by torch DCP's resharding planner, then Megatron Bridge's export): every exported tensor must be equal bit
for bit. Regions read by the streaming reader are also checked against the global tensors torch's own DCP ->
torch.save converter makes of the same files (tests/ckpt_io.py). The checkpoints come from real 2-iteration
training runs, one launch per process count (tests/parallel_driver.py), all in one test: under ``pytest -n 2`` a
shared fixture would be built once per worker. A missing shard file and another model's checkpoint are one-line
errors (exit 2) that write nothing.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import hf_fixtures
from ckpt_io import assert_bit_identical, load_safetensors, read_global_tensors
from parallel_driver import launch

# name -> (recipe, layout, processes); qwen3_proxy_adamw trains DP2 with the distributed optimizer (its preset's)
SAVED = {
    "kimi-tp2": ("kimi_k2_proxy_muon", "cpu-tp2", 2),
    "qwen3-dp2": ("qwen3_proxy_adamw", "cpu-dp2", 2),
    "kimi-tp2-ep2": ("kimi_k2_proxy_muon", "cpu-tp2-ep2", 4),
}


def _train_all(root: Path) -> dict[str, Path]:
    """Each of SAVED trained 2 iterations and saved, one torchrun launch per process count."""
    runs = {name: root / name for name in SAVED}
    for nproc in sorted({n for _, _, n in SAVED.values()}):
        plan = [["--recipe", recipe, f"layout={layout}", "train.train_iters=2", f"checkpoint.save={runs[name]}",
                 "checkpoint.save_interval=2", f"logger.tensorboard_dir={runs[name]}/tb"]
                for name, (recipe, layout, n) in SAVED.items() if n == nproc]  # fmt: skip
        launch(plan, root, nproc=nproc)
    return runs


def _stored_chunk_counts(iter_dir: Path) -> dict[str, int]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    return {key: len(m.chunks) for key, m in meta.items() if hasattr(m, "chunks") and not key.startswith("optimizer")}


@pytest.mark.slow
@pytest.mark.heavy  # every stack: tests/test_layout_matrix.py streams the same layouts' checkpoints (CI's budget)
@pytest.mark.once  # CI: 26.02 only (the matrix's exports run on every stack)
def test_checkpoints_saved_in_other_layouts_stream_export_as_the_model_built_export(nemo, tmp_path):
    from bridge_ext.checkpoints.torch_dist import TorchDistChunks

    runs = _train_all(tmp_path)
    for name, run in runs.items():
        iter_dir = run / "iter_0000002"
        counts = _stored_chunk_counts(iter_dir)
        # the layout is really in the files: under TP a layer's query projection is stored as 2 pieces
        query = [k for k in counts if k.endswith(("linear_qkv.weight", "linear_q_proj.weight", "linear_q_up_proj.weight"))]
        for key in query:
            layers = 1 if re.search(r"\.layers\.\d+\.", key) else TorchDistChunks(iter_dir).global_shape(key)[0]
            assert counts[key] == layers * (2 if "tp2" in name else 1), (name, key, counts[key])
        assert query, sorted(counts)
        out = {way: tmp_path / f"hf-{name}-{way}" for way in ("stream", "model")}
        streamed = nemo(["llm", "export", "--ckpt", run, "--out", out["stream"]], cwd=tmp_path)
        assert streamed.code == 0, streamed.stderr[-3000:]
        assert "converted through the built model" not in streamed.stdout + streamed.stderr  # it streamed
        built = nemo(["llm", "export", "--ckpt", run, "--out", out["model"], "--no-stream"], cwd=tmp_path)
        assert built.code == 0, built.stderr[-3000:]
        got, want = load_safetensors(out["stream"]), load_safetensors(out["model"])
        assert len(want) > 20 and any(".experts." in k for k in want) == name.startswith("kimi")
        assert_bit_identical(got, want, name)
        for file in ("config.json", "model.safetensors.index.json"):
            assert (out["stream"] / file).read_bytes() == (out["model"] / file).read_bytes(), (name, file)

    # any region, across stored chunk borders, equals that part of DCP's own global tensor
    iter_dir = runs["kimi-tp2-ep2"] / "iter_0000002"
    whole = {k: v for k, v in read_global_tensors(iter_dir).items() if not k.startswith("optimizer")}
    chunks = TorchDistChunks(iter_dir)
    generator = torch.Generator().manual_seed(0)
    try:
        checked = 0
        for key, tensor in whole.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                continue
            for _ in range(3):
                lo = [int(torch.randint(0, n, (), generator=generator)) for n in tensor.shape]
                size = tuple(int(torch.randint(1, n - o + 1, (), generator=generator)) for n, o in zip(tensor.shape, lo))
                region = chunks.read_region(key, tuple(lo), size)
                want = tensor[tuple(slice(o, o + s) for o, s in zip(lo, size))]
                assert region.dtype == want.dtype and torch.equal(region, want), (key, lo, size)
                checked += 1
        assert checked > 100
    finally:
        chunks.close()


@pytest.mark.slow
@pytest.mark.stack
def test_a_missing_shard_or_another_models_checkpoint_is_one_line_and_writes_nothing(nemo, tmp_path):
    from bridge_ext.convert import import_hf
    from recipes.models import HF_CONFIGS

    hf = hf_fixtures.qwen3_dir(tmp_path / "hf")
    ckpt = tmp_path / "mg"
    import_hf(hf, ckpt, progress=False, console=None)  # two writer threads: __0_0.distcp and __0_1.distcp
    iter_dir = ckpt / "iter_0000000"
    assert sorted(p.name for p in iter_dir.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]

    other = nemo(["llm", "export", "--ckpt", ckpt, "--out", tmp_path / "other",
                  "--hf-config", Path(HF_CONFIGS) / "kimi_k2_proxy"], cwd=tmp_path)  # fmt: skip
    assert other.code == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    line = [l for l in other.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "does not match the model" in line[0] and "kimi_k2_proxy" in line[0], other.stderr
    assert not (tmp_path / "other").exists()

    gone = iter_dir / "__0_1.distcp"
    shutil.move(gone, tmp_path / "moved.distcp")
    for stream in ([], ["--no-stream"]):
        out = tmp_path / f"hf-out{len(stream)}"
        done = nemo(["llm", "export", "--ckpt", ckpt, "--out", out, *stream], cwd=tmp_path)
        assert done.code == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        errors = [l for l in done.stderr.splitlines() if l.startswith("error:")]
        assert len(errors) == 1, done.stderr
        # which tensor the file held first depends on the stack's save order: any name, then its region
        assert re.search(rf"{re.escape(str(gone))} is missing \(it holds [\w.]+ at \[\d", errors[0]), errors[0]
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]
