"""A run's console (``bridge_ext.upstream_output.run_console``): our lines and Megatron's iteration lines; what
upstream prints besides (its setup, warnings no user acts on, one gloo line per process group) in a log file whose
path the run prints; ``--verbose`` shows everything."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from bridge_ext.upstream_output import NOISE, destination
from tests.nemo_cli import NEMO

ITERATION = re.compile(r"\biteration\s+\d+/\s*\d+ \|")  # Megatron Bridge's training_log line


@pytest.mark.parametrize(("line", "gpu", "warning", "where"), [
    # progress
    (" [2026-12-04 16:25:26] iteration        5/      10 | consumed samples:           40 | lm loss: 8.27 |",
     False, False, "console"),
    ("saving checkpoint at iteration      10 to runs/demo/checkpoints in torch_dist format", False, False, "console"),
    ("Step Time : 6.54s GPU utilization: 0.0MODEL_TFLOP/s/GPU", False, False, "log"),
    ("Step Time : 1.20s GPU utilization: 412.3MODEL_TFLOP/s/GPU", True, False, "console"),
    # chatter
    ("[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0", False, False, "log"),
    ("> initialized tensor model parallel with size 1", False, False, "log"),
    ("  error_injection_type: transient_error", False, False, "log"),  # a line of the config Megatron prints
    # warnings: known and harmless, harmless only without a GPU, unknown
    ("The pynvml package is deprecated. Please install nvidia-ml-py instead.", True, True, "log"),
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", False, True, "log"),
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", True, True, "console"),
    ("lr_warmup_steps (40) >= lr_decay_steps (16); capping lr_warmup_steps to 15.", False, True, "console"),
    ("Transformer Engine cross entropy loss fusion has known stability issues. Megatron-LM training args validation "
     "rejects this combination by default. Use cross_entropy_fusion_impl='native'", False, True, "console"),
    ("TrainingConfig.eval_iters is deprecated and will be removed in a future release.", False, True, "log"),
    ("WARNING: could not find the metadata file runs/x/latest_checkpointed_iteration.txt", False, False, "console"),
    ("[rank1]: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp", True, False, "console"),
    ("Traceback (most recent call last):", False, False, "console"),
])
def test_where_a_line_goes(line, gpu, warning, where):
    assert destination(line, gpu=gpu, warning=warning) == where


def _demo(cwd, *extra: str) -> list[str]:
    """`make demo`'s command (Makefile) for 10 iterations (two iteration lines, log interval 5; 5 iterations would
    be the warm-up's length, which Megatron Bridge warns about), stdout and stderr as a terminal shows them: one
    stream, in order."""
    cwd.mkdir()
    run = subprocess.run([str(NEMO), "llm", "pretrain", "--recipe", "kimi_k2_proxy_muon",
                          "checkpoint.save=runs/demo/checkpoints", "checkpoint.load=runs/demo/checkpoints",
                          "logger.tensorboard_dir=runs/demo/tb_logs", "train.train_iters=10", *extra],
                         cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout[-3000:]
    return run.stdout.splitlines()


def _masked(lines) -> set[str]:
    """Lines without their numbers (times, timestamps, process ids, object addresses) or surrounding blanks."""
    return {re.sub(r"\d+", "#", re.sub(r"0x[0-9a-f]+", "0x#", line)).strip() for line in lines} - {""}


@pytest.mark.slow
def test_the_demo_shows_our_lines_and_megatrons_iterations_and_logs_the_rest(tmp_path):
    quiet = _demo(tmp_path / "quiet")
    first = next(i for i, line in enumerate(quiet) if ITERATION.search(line))
    assert first <= 15, "\n".join(quiet[:first + 1])
    announced = [line for line in quiet if line.startswith("upstream output")]
    assert len(announced) == 1 and announced[0].split(": ", 1)[1].split(";")[0] == "runs/demo/checkpoints/upstream.log"
    log = (tmp_path / "quiet" / "runs" / "demo" / "checkpoints" / "upstream.log").read_text().splitlines()
    assert not any(ITERATION.search(line) for line in log)

    verbose = _demo(tmp_path / "verbose", "--verbose")
    assert not any(line.startswith("upstream output") for line in verbose)
    assert not (tmp_path / "verbose" / "runs" / "demo" / "checkpoints" / "upstream.log").exists()
    # the known noise of this stack (26.02: pynvml, the TE / Apex fallbacks, one [Gloo] line per process group):
    # in the log, not on the quiet console
    noise = _masked(line for line in verbose if any(re.search(n.pattern, line) for n in NOISE))
    assert noise and noise <= _masked(log) and not noise & _masked(quiet), (noise, noise & _masked(quiet))
    # nothing is lost: what --verbose shows is on the quiet console or in its log, and --verbose shows the log
    assert _masked(verbose) <= _masked(quiet) | _masked(log), sorted(_masked(verbose) - _masked(quiet) - _masked(log))
    assert _masked(log[1:]) <= _masked(verbose), sorted(_masked(log[1:]) - _masked(verbose))  # [0]: the log's header
    # the same iteration, the same loss
    assert [line.split("| lm loss:")[1].split("|")[0] for line in quiet if ITERATION.search(line)] == \
        [line.split("| lm loss:")[1].split("|")[0] for line in verbose if ITERATION.search(line)]
