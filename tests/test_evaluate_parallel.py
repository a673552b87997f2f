"""``nemo llm evaluate`` under torchrun on CPU (two processes, gloo): at TP2 the held-out loss equals the one-process
number and what the training loop printed, within 1e-5 (fp32; TP splits each matmul's and the cross-entropy's sums
over two ranks); rank 0 alone prints. The Muon run is tests/evaluate_generate_runs.py's (trained once per process).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate_generate_runs as shared

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5  # nats, on a loss of ~8.3: TP's float summation order


def torchrun_evaluate(argv: list, *, nproc: int, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC -m bridge_ext.commands llm evaluate ARGV`` from this interpreter's venv and
    this checkout, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "bridge_ext.commands", "llm",
               "evaluate", *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, (
        str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.once  # resharding and TP are megatron-core's; TP on CPU on every stack: tests/test_parallel_cpu.py
@pytest.mark.slow
def test_tp2_under_torchrun_equals_one_process_and_the_training_loop(nemo, tmp_path_factory, tmp_path):
    ckpt = shared.trained(tmp_path_factory, "qwen3")
    printed = float(shared.printed_validation(ckpt)[1][0][0])
    one = nemo(["llm", "evaluate", "--ckpt", ckpt, "--iteration", "1", "--json"])
    assert one.code == 0, one.stderr[-3000:]
    one_process = json.loads(one.stdout.strip().splitlines()[-1])["loss"]
    done = torchrun_evaluate(["--ckpt", ckpt, "--iteration", "1", "--json", "--tp", "2"], nproc=2, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]  # stdout: JSON lines only
    assert len(rows) == 1 and rows[0]["iteration"] == 1 and rows[0]["eval_tokens"] == 8 * 128  # rank 0 alone
    assert abs(rows[0]["loss"] - one_process) <= TOLERANCE
    assert abs(rows[0]["loss"] - printed) <= TOLERANCE + 5e-6 * printed  # printed to 7 significant digits


@pytest.mark.once
def test_tp_refused_where_the_launch_cannot_hold_it(nemo, tmp_path):
    result = nemo(["llm", "evaluate", "--ckpt", tmp_path / "nothing", "--tp", "2"])
    assert result.code == 2 and "--tp 2 needs a multiple of 2 processes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = nemo(["llm", "evaluate", "--ckpt", tmp_path, "--tp", "2", "--choices", tmp_path / "mc.jsonl"])
    assert result.code == 2 and "--tp does not apply to --choices" in result.stderr
