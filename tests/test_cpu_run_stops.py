"""How a CPU run stops: at its time limit (``train.exit_duration_in_mins``), and on a NaN loss.

Megatron Bridge checks the time limit after every training iteration (train.py ``checkpoint_and_decide_exit``)
and after every evaluation iteration (eval.py ``evaluate``) on a CUDA tensor, synchronizes CUDA every
``train.train_sync_interval`` iterations, and megatron-core's rerun state machine names the CUDA device in the
error that a NaN loss raises: CPU mode's ``cuda-on-cpu`` rows of those three modules let the same code run on a
CPU. With one of those rows switched off (``BRIDGE_EXT_PATCHES_OFF``) a test here fails on CUDA: train.py's row,
both time-limit tests (the synchronization, the training loop's check); eval.py's, both; the rerun state
machine's, the NaN test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.nemo_cli import nemo_process

pytestmark = [pytest.mark.slow, pytest.mark.once]

# the tiniest proxy, mock data; validation after every iteration, two batches each
RUN = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "--device", "cpu", "--data", "mock",
       "train.train_iters=2", "train.eval_interval=1", "train.eval_iters=2"]
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _output(result, ckpt: Path) -> str:
    """What a failed run printed, for the assertion message: the console, then the end of its upstream.log."""
    log = ckpt / "upstream.log"
    return (result.stderr + (log.read_text() if log.exists() else ""))[-3000:]


def _saved_iteration(ckpt: Path) -> int:
    """The iteration Megatron's text tracker names (its ``iter_*`` directory is checked to exist)."""
    step = int((ckpt / "latest_checkpointed_iteration.txt").read_text().strip())
    assert (ckpt / f"iter_{step:07d}").is_dir(), sorted(p.name for p in ckpt.iterdir())
    return step


def _trained_iterations(ckpt: Path) -> list[int]:
    """The iterations whose training loss the run recorded (``losses.jsonl`` next to the checkpoints)."""
    from bridge_ext.training import read_losses

    return list(read_losses(ckpt / "losses.jsonl"))


@pytest.fixture
def megatron_globals_reset():
    """A run that Megatron Bridge ends with ``sys.exit`` (a time limit), or an error, skips its own cleanup
    (``_finish_train``): clear what it left in this process (as tests/test_cpu_training.py does after
    ``exit_interval``), or the next in-process run fails ("num microbatches calculator is already initialized")."""
    yield
    from bridge_ext.process_state import reset_megatron_globals

    reset_megatron_globals()


def test_a_time_limit_never_reached_trains_and_validates_every_iteration(nemo, tmp_path, megatron_globals_reset):
    """``train.exit_duration_in_mins`` far away, CUDA-synchronized every iteration, validated every iteration:
    the run checks its time limit after each training and validation iteration, and trains to its last one."""
    ckpt = tmp_path / "ckpt"
    result = nemo([*RUN, "train.exit_duration_in_mins=100000", "train.train_sync_interval=1",
                   f"checkpoint.save={ckpt}"], cwd=tmp_path)
    assert result.code == 0, _output(result, ckpt)
    assert _saved_iteration(ckpt) == 2
    assert _trained_iterations(ckpt) == [1, 2]
    log = (ckpt / "upstream.log").read_text()
    validated = [int(m[1]) for m in VALIDATION.finditer(log)]
    assert validated == [1, 2], validated  # (after training: "... at iteration 2 on validation set", not matched)
    assert "timelimit reached" not in log and "exiting program after" not in log


def test_a_time_limit_reached_stops_at_the_first_iteration_and_saves_it(nemo, tmp_path, megatron_globals_reset):
    """``train.exit_duration_in_mins=1e-6`` (under a millisecond): the first validation stops at its time-limit
    check, then the training loop's check saves a checkpoint at iteration 1 of 2 and ends the run with exit 0."""
    ckpt = tmp_path / "ckpt"
    result = nemo([*RUN, "train.exit_duration_in_mins=1e-6", f"checkpoint.save={ckpt}"], cwd=tmp_path)
    assert result.code == 0, _output(result, ckpt)
    assert _saved_iteration(ckpt) == 1  # of train.train_iters=2
    assert _trained_iterations(ckpt) == [1]
    log = (ckpt / "upstream.log").read_text()
    assert "Exiting during evaluation, timelimit reached" in log  # eval.py's check, in the first validation
    assert re.search(r"exiting program after \d\S* minutes", log), log[-3000:]  # train.py's check
    assert not VALIDATION.search(log)  # the validation cut short prints no loss
    # as after a stop on the exit signal: what stopped it, where it saved, the run's summary and loss curve
    assert ("stopped at its time limit (train.exit_duration_in_mins=1e-06) at iteration 1, saved to "
            f"{ckpt}; run the same command to resume") in result.stderr, result.stderr[-3000:]
    assert f"loss curve:      {ckpt / 'loss.png'}" in result.stdout and (ckpt / "loss.png").stat().st_size > 0


def test_a_nan_loss_stops_the_run_with_megatrons_message(tmp_path):
    """A loss that is NaN from the first step (``model.layernorm_epsilon=nan``: every norm's output is NaN)
    stops the run with megatron-core's rerun-state-machine error, exit 1, nothing saved; not with a CUDA error.
    A real process: an in-process run that raises inside training was seen to hang afterwards."""
    ckpt = tmp_path / "ckpt"
    result = nemo_process(["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "--device", "cpu", "--data", "mock",
                           "train.train_iters=1", "model.layernorm_epsilon=nan", f"checkpoint.save={ckpt}"],
                          cwd=tmp_path, timeout=300)
    assert result.code == 1, result.stderr[-3000:]
    # (the iteration it names is the rerun state machine's count: 1 on megatron-core 0.16, 2 on 0.19)
    assert re.search(r"RuntimeError: Rank 0, node \S+, device \S+, iteration \d+: Unexpected result nan "
                     r"\(message='found NaN in local forward loss calculation'\)", result.stderr), result.stderr[-3000:]
    assert "NVIDIA" not in result.stderr and "CUDA" not in result.stderr
    assert _trained_iterations(ckpt) == []  # the first step did not end
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
