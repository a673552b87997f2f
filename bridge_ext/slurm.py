"""What a Slurm submission needs beyond NeMo-Run: a check against the real scheduler before anything is written,
the job script's lines for ranks started by ``srun`` and for requeueing, and what the job's ranks read.

- :func:`preflight`: ``sbatch`` is on the PATH, the job directory is writable, and ``sbatch --test-only`` accepts
  the request (partition, account, time limit, node and task counts: the scheduler's own answer, nothing
  submitted); each refusal is one :class:`UserError` line with the scheduler's reason.
- :func:`setup_lines`: lines NeMo-Run puts in its sbatch script before ``srun`` (``SlurmExecutor.setup_lines``):
  the rendezvous address for ranks that ``srun`` starts directly (no torchrun: Slurm's signals reach every rank,
  and a rank that saved and exited 0 ends the step with 0), and, with ``--requeue``, an ``EXIT`` trap that
  requeues the job when its run stopped on its exit signal or ``train.exit_duration_in_mins`` and saved
  (``scontrol requeue``; the next attempt resumes).
- :func:`adopt_slurm_ranks`, :func:`note_stopped_run`: in the ranks (``bridge_ext.commands.pretrain``).

Time limits: ``--signal=TERM@S`` asks Slurm for SIGTERM ``S`` seconds before the limit (Slurm may send it up to
60 s earlier: its timer's resolution, ``man sbatch``); Megatron Bridge's exit-signal handler then finishes the
iteration, saves and exits 0 (``bridge_ext.kill_safe``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from bridge_ext.errors import UserError
from bridge_ext.runtime import is_rank_zero, launcher_set_ranks

__all__ = ["RANKS_FROM", "REQUEUE_FILE", "adopt_slurm_ranks", "note_stopped_run", "parse_time", "preflight",
           "scheduler_reason", "setup_lines"]

RANKS_FROM = "BRIDGE_EXT_RANKS_FROM"  # "slurm": the launch started one process per rank with srun
REQUEUE_FILE = "BRIDGE_EXT_REQUEUE_FILE"  # where rank 0 notes a run that stopped early and saved (--requeue)


def parse_time(text: str) -> int:
    """Seconds in a Slurm time limit: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S`` (``man sbatch``)."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise UserError(f"--time '{text}' is not a Slurm time limit (e.g. 04:00:00, 90, 1-00:00:00)")
    days, first, second, third = match.groups()
    if days is not None:  # D-H[:M[:S]]
        seconds = int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    elif third is not None:  # H:M:S
        seconds = int(first) * 3600 + int(second) * 60 + int(third)
    else:  # M or M:S
        seconds = int(first) * 60 + int(second or 0)
    if seconds <= 0:
        raise UserError(f"--time '{text}' is no time at all")
    return seconds


def preflight(*, job_dir: Path, sbatch_options: list[str]) -> None:
    """Refuse what the scheduler would refuse, before anything is written (see the module docstring)."""
    if shutil.which("sbatch") is None:
        raise UserError("no Slurm here: `sbatch` is not on the PATH (submit from a Slurm login node, or use "
                        "--executor local)")
    _check_writable(job_dir)
    try:
        test = subprocess.run(["sbatch", "--test-only", *sbatch_options, "--wrap", "true"], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise UserError("Slurm's controller did not answer `sbatch --test-only` within 60 s; try again, or ask "
                        "the cluster's admins (`sinfo` shows whether it is up)") from None
    if test.returncode != 0:
        raise UserError(f"Slurm refuses the job: {scheduler_reason(test.stderr)}")


def scheduler_reason(stderr: str) -> str:
    """sbatch's reason in one line (``sbatch: error: ...`` / ``allocation failure: ...``: the first, the most
    specific: "invalid partition specified: NAME" before "Invalid partition name specified")."""
    lines = [re.sub(r"^(sbatch: error: |allocation failure: |Batch job submission failed: )+", "", line.strip())
             for line in stderr.splitlines() if line.strip()]
    reasons = [line for line in lines if line]
    return reasons[0] if reasons else "sbatch failed without a message"


def _check_writable(job_dir: Path) -> None:
    existing = job_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--job-dir {job_dir}: {existing} is not a writable directory (the job writes its script, "
                        "logs and config there; pick a shared directory the nodes can write)")


def setup_lines(*, requeue_dir: Path | None) -> str:
    """The job script's lines before ``srun`` (``SlurmExecutor.setup_lines``; NeMo-Run's script has set
    ``head_node_ip`` from the first node by then)."""
    lines = [
        "# ranks started by srun (one per GPU, no torchrun): rendezvous at the first node (bridge_ext.slurm)",
        "export MASTER_ADDR=${head_node_ip%% *}",
        "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))",
    ]
    if requeue_dir is not None:
        lines += [
            "# --requeue: a run stopped on its exit signal (time limit, preemption) or train.exit_duration_in_mins "
            "saved; requeue to resume it",
            f'export {REQUEUE_FILE}={shlex.quote(str(requeue_dir))}/.requeue-"$SLURM_JOB_ID"',
            f'trap \'if [ -f "${REQUEUE_FILE}" ]; then rm -f "${REQUEUE_FILE}"; '
            'echo "requeueing job $SLURM_JOB_ID: the run stopped early and saved"; '
            'scontrol requeue "$SLURM_JOB_ID"; fi\' EXIT',
        ]
    return "\n".join(lines)


def adopt_slurm_ranks() -> None:
    """In a rank ``srun`` started (our launch sets ``BRIDGE_EXT_RANKS_FROM=slurm``): torchrun's ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` from ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID``, the names
    Megatron Bridge's ``utils/slurm_utils.py`` falls back to, so our code and upstream's see the same ranks."""
    if os.environ.get(RANKS_FROM) != "slurm" or launcher_set_ranks():
        return
    for ours, slurm in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"), ("LOCAL_RANK", "SLURM_LOCALID")):
        if slurm not in os.environ:
            raise UserError(f"{RANKS_FROM}=slurm but {slurm} is unset: start the ranks with srun")
        os.environ[ours] = os.environ[slurm]


def note_stopped_run() -> None:
    """After a run stopped on its exit signal or time limit and saved: rank 0 leaves the file the job script's trap
    requeues on."""
    path = os.environ.get(REQUEUE_FILE)
    if path and is_rank_zero():
        Path(path).write_text(f"stopped early and saved; job {os.environ.get('SLURM_JOB_ID', '?')}\n")
