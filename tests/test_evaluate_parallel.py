"""``nemo llm evaluate`` and ``nemo llm generate`` under torchrun on CPU (two processes, gloo, one launch for both:
tests/evaluate_generate_rank_driver.py), on the run ``make demo`` makes (Kimi K2 proxy: MLA + MoE), at TP2: the
held-out loss equals the one-process number and what the training loop printed, within 1e-5 (fp32; TP splits each
matmul's and the cross-entropy's sums over two ranks); greedy text equals transformers' on the export, token for
token; rank 0 alone prints. The run is tests/evaluate_generate_runs.py's (made once per session).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import evaluate_generate_runs as shared
from tests.parallel_driver import launch_ranks

DRIVER = Path(__file__).resolve().with_name("evaluate_generate_rank_driver.py")
TOLERANCE = 1e-5  # nats, on a loss of ~8.3: TP's float summation order
PROMPTS = ["def main(", "import os\nclass ", "    return self."]


@pytest.mark.once  # resharding and TP are megatron-core's; TP on CPU on every stack: tests/test_parallel_cpu.py
@pytest.mark.slow
def test_tp2_under_torchrun_evaluate_equals_one_process_and_generate_equals_transformers(nemo, tmp_path_factory,
                                                                                        tmp_path):
    ckpt, hf = shared.trained(tmp_path_factory, "demo"), shared.exported(tmp_path_factory, "demo")
    printed = float(shared.printed_validation(ckpt)[2][0][0])
    one = nemo(["llm", "evaluate", "--ckpt", ckpt, "--json"])
    assert one.code == 0, one.stderr[-3000:]
    one_process = json.loads(one.stdout.strip().splitlines()[-1])["loss"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"phases": [
        ["llm", "evaluate", "--ckpt", str(ckpt), "--json", "--tp", "2"],
        ["llm", "generate", "--ckpt", str(ckpt), "--prompts", str(prompts), "--json", "--max-new-tokens", "12",
         "--tp", "2"]]}))
    done = launch_ranks(DRIVER, [plan], tmp_path, nproc=2, timeout=600, launcher="torchrun")  # what it tests
    # rank 0's JSON lines (the driver's own group creation prints gloo's "[Gloo] Rank R is connected" lines)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1 + len(PROMPTS)
    evaluated, generated = lines[0], lines[1:]
    assert evaluated["iteration"] == 2
    assert abs(evaluated["loss"] - one_process) <= TOLERANCE
    assert abs(evaluated["loss"] - printed) <= TOLERANCE + 5e-6 * printed  # printed to 7 significant digits
    for prompt, row, reference in zip(PROMPTS, generated, shared.transformers_greedy(hf, PROMPTS, 12), strict=True):
        assert row["prompt"] == prompt and row["tokens"] == reference


@pytest.mark.once
def test_tp_refused_where_the_launch_cannot_hold_it(nemo, tmp_path):
    result = nemo(["llm", "evaluate", "--ckpt", tmp_path / "nothing", "--tp", "2"])
    assert result.code == 2 and "--tp 2 needs a multiple of 2 processes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = nemo(["llm", "evaluate", "--ckpt", tmp_path, "--tp", "2", "--choices", tmp_path / "mc.jsonl"])
    assert result.code == 2 and "--tp does not apply to --choices" in result.stderr
    result = nemo(["llm", "generate", "--ckpt", tmp_path, "--prompt", "x", "--tp", "2"])
    assert result.code == 2 and "--tp must equal the number of processes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
