"""The GPU tier's one command (bench/gpu_check.sh) is ready on every machine: its shell parses, its CPU dry run
names every step and builds each recipe and layout it will train, and its curve comparison does what it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_tier.plan import CURVE_MEAN_ABS_TOL, compare_curve, plan_steps  # noqa: E402


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")]).returncode == 0


@pytest.mark.slow
def test_dry_run_checks_every_recipe_and_layout(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "gpu")}
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    steps = plan_steps(iters=50, steps=12)
    lines = [line for line in run.stdout.splitlines() if line.split(" ")[0] in {s["step"] for s in steps}]
    assert len(lines) == len(steps) == 10  # env, 3 proxies x 2 presets, Qwen3-0.6B x 2, rehearse
    for step, line in zip(steps, lines):
        assert line.startswith(step["step"])
        if "recipe" in step:  # built and validated as the GPU run builds it: one GPU, bf16
            assert step["recipe"] in line and "[ok: 1 GPU" in line and "bf16]" in line, line
    assert "16 x 4096" in lines[7] and "8 x 128" in lines[1]
    assert not list((tmp_path / "gpu").glob("*")), "a dry run writes nothing"


def test_curve_comparison_by_hand():
    ref = [8.0, 7.0, 6.0, 5.0]
    same = compare_curve(ref, ref)
    assert same == {"match": True, "mean_abs_diff": 0.0, "tail_rel_diff": 0.0}
    shifted = compare_curve([x + 0.04 for x in ref], ref)  # 0.04 < the 0.05 tolerance; tail 0.04 / 6.5
    assert shifted["match"] and shifted["mean_abs_diff"] == 0.04 and shifted["tail_rel_diff"] == round(0.04 / 6.5, 4)
    off = compare_curve([x + 2 * CURVE_MEAN_ABS_TOL for x in ref], ref)
    assert not off["match"] and off["mean_abs_diff"] == 0.1
    assert compare_curve([], ref) == {"match": False, "why": "no losses"}


@pytest.mark.slow
def test_te_dry_run_checks_the_te_path_without_transformer_engine(tmp_path):
    """``--te --dry-run`` on CPU: every TE step planned (TE probe, fp8 rows, QK-clip on MLA and GQA, the round
    trip), each config the TE spec a GPU with TE trains, the fp8 recipes Megatron Bridge has; TE never imported."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "gpu")}
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--te", "--dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    steps = plan_steps(iters=50, steps=12, te=True)
    kinds = [s["step"] for s in steps]
    assert kinds.count("fp8") == 4 and kinds.count("qk_clip") == 2 and kinds.count("round_trip") == 2
    assert "te_probe" in kinds
    lines = [line for line in run.stdout.splitlines() if line.split(" ")[0] in set(kinds)]
    assert len(lines) == len(steps)
    for step, line in zip(steps, lines):
        if "recipe" in step:
            assert step["recipe"] in line and "TE spec" in line, line
    assert any("MLA" in line for line in lines) and any("GQA" in line for line in lines)
    assert "transformer_engine: not imported" in run.stdout
    assert not list((tmp_path / "gpu").glob("*")), "a dry run writes nothing"


@pytest.mark.once
def test_te_carrier_splits_and_plans_within_the_call_limit(tmp_path, monkeypatch):
    """bench/te/te.py on a small stand-in wheel: pieces + manifest, joined sha256, the call plan."""
    sys.path.insert(0, str(REPO / "bench" / "te"))
    import te as carrier

    dist, pieces = tmp_path / "dist", tmp_path / "pieces"
    dist.mkdir()
    wheel = dist / f"transformer_engine_cu13-{carrier.TE_VERSION}-py3-none-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(os.urandom(2500))
    (dist / f"transformer_engine_torch-{carrier.TE_VERSION}.tar.gz").write_bytes(b"sdist")
    monkeypatch.setattr(carrier, "DIST", dist)
    monkeypatch.setattr(carrier, "PIECES", pieces)
    manifest = carrier.split(piece_bytes=1000)
    assert [p["bytes"] for p in manifest["pieces"]] == [1000, 1000, 500]
    assert manifest["parts"] == ["part-01", "part-02", "part-03"] and manifest["files"][0]["part"] == "part-03"
    assert carrier.check() == 0
    calls = carrier.plan(manifest)
    assert [c["carry"] for c in calls[:3]] == [[f"bench/te/pieces/part-0{i}"] for i in (1, 2, 3)]
    assert "install" in calls[2]["command"] and calls[-1]["carry"] == [".whl"]


def _write_safetensors(directory: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.once
def test_round_trip_comparison_by_hand(tmp_path):
    """bench/te/workers.py's comparison: per tensor ||A - B|| / ||B - imported||, against the 2 % tolerance."""
    import torch

    sys.path.insert(0, str(REPO / "bench" / "te"))
    from workers import compare_exports

    from gpu_tier.plan import ROUND_TRIP_REL_TOL

    gen = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(8, 4, generator=gen), "n": torch.ones(4)}
    update = {"w": 0.01 * torch.randn(8, 4, generator=gen), "n": torch.full((4,), 1e-3)}
    local = {k: src[k] + update[k] for k in src}
    source, b = _write_safetensors(tmp_path / "src", src), _write_safetensors(tmp_path / "local", local)
    near = _write_safetensors(tmp_path / "near", {k: local[k] + 0.5 * ROUND_TRIP_REL_TOL * update[k] for k in src})
    far = _write_safetensors(tmp_path / "far", {"w": local["w"] + 2 * ROUND_TRIP_REL_TOL * update["w"],
                                                "n": local["n"]})
    same = compare_exports(b, b, source)
    assert same["ok"] and same["max_rel_of_update"] == 0.0 and same["moved"] == 2
    ok = compare_exports(near, b, source)
    assert ok["ok"] and ok["max_rel_of_update"] == pytest.approx(0.5 * ROUND_TRIP_REL_TOL, rel=1e-2)  # float32 sums
    bad = compare_exports(far, b, source)
    assert not bad["ok"] and bad["worst_tensor"] == "w"
    assert bad["max_rel_of_update"] == pytest.approx(2 * ROUND_TRIP_REL_TOL, rel=1e-2)
    unmoved = compare_exports(near, source, source)  # B did not move at all: A moving is a problem
    assert not unmoved["ok"] and unmoved["unmoved"] == ["n", "w"]


@pytest.mark.once
@pytest.mark.slow
def test_te_workers_rehearse_on_cpu_with_the_local_spec(tmp_path):
    """``bench/gpu_check.sh --te --rehearse`` on the smallest proxy (Qwen3, GQA with QK-norm off): the QK-clip worker
    trains 5 steps with three heads forced to logits far above tau and measures tau again after the last clip; the
    round-trip worker imports a random HF directory, trains one step twice (local spec both times) and compares the
    two exports (identical on CPU). Neither imports transformer_engine. ~30 s of CPU time (two processes)."""
    import json

    from gpu_tier.plan import QK_CLIP_TAU

    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "gpu")}
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--te", "--rehearse", "--recipe",
                          "qwen3_proxy_muon"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    results = json.loads((tmp_path / "gpu" / "gpu_check.json").read_text())
    clip = results["qk_clip"]["qwen3_proxy_muon"]
    assert clip["ok"] and clip["spec"] == "local" and clip["attention"] == "GQA" and not clip["qk_layernorm"]
    assert clip["te_modules"] == 0 and not clip["transformer_engine_imported"]
    steps = clip["telemetry_max_per_step_and_layer"]
    assert len(steps) == 5 and max(steps[0]) > 10 * QK_CLIP_TAU  # the forced heads start far above tau
    assert max(steps[-1]) > QK_CLIP_TAU  # and the last step still had something to clip
    assert clip["after_clip_max"] == pytest.approx(QK_CLIP_TAU, rel=1e-5)  # lr 0 in the last step: tau exactly
    assert clip["measured_vs_recomputed_rel"] <= 1e-6
    trip = results["round_trip"]["qwen3_proxy_muon"]
    assert trip["ok"] and trip["specs"] == ["local", "local"] and trip["moved"] == trip["tensors"] == 25
    assert trip["max_rel_of_update"] == 0.0  # one process, fp32, the same batches: bit-identical
    assert trip["losses"]["local0"] == trip["losses"]["local1"]
    assert all(s["te_modules"] == 0 and not s["transformer_engine_imported"] for s in trip["steps"].values())
    table = (tmp_path / "gpu" / "gpu_check.md").read_text()
    assert "CPU rehearsal" in table and "| qwen3_proxy_muon (tau 5.0) | GQA | local |" in table
