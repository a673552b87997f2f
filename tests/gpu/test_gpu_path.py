"""What only a GPU can check, asserted on one run of ``bench/gpu_check.py`` (its JSON; see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    given = os.environ.get("GPU_CHECK_RESULTS")
    if given:
        return json.loads(Path(given).read_text())
    out = tmp_path_factory.mktemp("gpu")
    subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(out)], cwd=REPO, check=False)
    return json.loads((out / "gpu_check.json").read_text())


def test_every_step_ran(results):
    assert results["env"]["ok"] and results["env"]["cuda_available"]
    failed = [name for part in ("proxies", "qwen3_0p6b") for name, r in results[part].items() if not r["ok"]]
    assert failed == []
    assert results["rehearse"]["ok"]


def test_proxies_learn_in_bf16_on_the_gpu(results):
    """50 iterations on the text corpus: the mean loss of the last 10 is at least 15 % below the first; no NaN."""
    for name, run in results["proxies"].items():
        losses = run["losses"]
        assert len(losses) == run["iters"] and all(loss == loss for loss in losses), name
        assert sum(losses[-10:]) / 10 < 0.85 * losses[0], (name, losses[0], losses[-10:])


def test_proxy_curves_match_the_stored_reference(results):
    """Curves of the same recipe, layout and data on the same kind of GPU (tests/gpu/reference, written by the
    first run of the check): bf16 is not bit-reproducible, so within gpu_check's tolerances."""
    compared = {name: r["reference"] for name, r in results["proxies"].items() if "reference" in r}
    if not compared:
        pytest.skip("no stored reference curves yet: this run wrote them (commit $OUT/proxy_curves.json)")
    assert {name: c for name, c in compared.items() if not c["match"]} == {}


def test_muon_costs_little_beside_adamw_on_qwen3_0p6b(results):
    """Muon's optimizer step on one GPU: Newton-Schulz runs (its share is measured), the step stays within 25 %
    of AdamW's (NVIDIA's 2026-04 benchmark: Newton-Schulz is ~5 % of Muon's FLOPs at scale), and the model
    FLOP rate is that of a real GPU (over 50 TFLOP/s even on the unfused local spec)."""
    muon, adamw = results["qwen3_0p6b"]["qwen3_0p6b_muon"], results["qwen3_0p6b"]["qwen3_0p6b_adamw"]
    assert muon["newton_schulz_ms"] and muon["newton_schulz_ms"] > 0
    assert not adamw["newton_schulz_ms"]
    assert muon["step_ms"] < 1.25 * adamw["step_ms"]
    assert min(muon["model_tflops"], adamw["model_tflops"]) > 50


def test_rehearsal_memory_beside_the_real_run(results):
    """``nemo llm rehearse --device cuda`` builds the same rank and runs one micro-batch and one optimizer step:
    its max allocated memory is the real run's within a factor of 2 (the real run holds the data loader's
    batches and the logging buffers; the ratio is reported in docs/launch.md)."""
    ratio = results["rehearse"]["rehearsal_over_real"]
    assert 0.5 < ratio < 2.0
