"""One run in its own process (``python -m bridge_ext.compare --worker SPEC``): the parent's side (start it,
follow its losses, report its failure in one line) and the worker's (train the spec, stream the losses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bridge_ext.compare.config import configure, run_settings
from bridge_ext.compare.runs import Run, RunResult
from bridge_ext.errors import UserError

__all__ = ["main", "read_losses", "read_settings", "run_worker", "train_one"]


def _worker(spec_path: Path) -> int:
    """Train one run (spec written by the parent) and stream its per-iteration losses to JSON lines."""
    from bridge_ext.build import megatron_warnings_once

    megatron_warnings_once()  # a real run: Megatron's warnings go to train.log, each once
    train_one(json.loads(spec_path.read_text()))
    return 0


def train_one(spec: dict[str, Any], *, callbacks: Sequence[Any] = ()) -> None:
    """What a worker process runs for one spec, in this process (``callbacks`` join the run's own)."""
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from bridge_ext import data, training

    # the parent's corpus, which it has prepared already
    data.CORPUS_MAX_BYTES = spec.get("corpus_max_bytes", data.CORPUS_MAX_BYTES)
    run = Run(spec["recipe"], spec["overrides"], spec["label"])
    if spec.get("finetune"):
        from bridge_ext.training import run_finetune

        cfg, recipe, _ = configure(run, iters=spec["iters"], seed=spec["seed"], data=spec["data"],
                                   common=spec["common"], quiet=True)
        cfg.logger.tensorboard_dir = spec["tensorboard"]  # Megatron Bridge's own record of the losses
        run_finetune(recipe, cfg, data=spec["data"], device=spec["device"], callbacks=list(callbacks), quiet=True,
                     record_dir=Path(spec["losses"]).parent, loss_extra={"config": run_settings(cfg, recipe)},
                     telemetry=False)
        return
    # data="mock" here: training.prepare below sets the run's data (text corpus or mock) exactly once
    cfg, recipe, _ = configure(run, iters=spec["iters"], seed=spec["seed"], data="mock", common=spec["common"],
                               quiet=True)
    prepared = training.prepare(recipe, cfg, device=spec["device"], data=spec["data"], quiet=True, telemetry=False)
    recorder = training.loss_recorder(Path(spec["losses"]), extra={"config": run_settings(cfg, recipe)})
    training.run_pretrain(cfg, prepared, callbacks=[recorder, *callbacks])


def read_settings(path: Path) -> dict[str, Any]:
    from bridge_ext.training import read_records

    return next((r["config"] for r in read_records(path) if "config" in r), {})


def read_losses(path: Path) -> tuple[list[float], list[float], bool]:
    from bridge_ext.training import read_records

    records = read_records(path)
    steps = [r for r in records if "loss" in r]
    return [r["loss"] for r in steps], [r["time"] for r in steps], any(r.get("done") for r in records)


def _tail(path: Path, lines: int = 1) -> str:
    if not path.exists():
        return ""
    text = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in text if ln.startswith("error:") or "Error" in ln]
    return (errors or text)[-1][:300] if text else ""


def run_worker(run: Run, spec: dict, run_dir: Path, progress, task) -> RunResult:
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n")
    losses_path = Path(spec["losses"])
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds bridge_ext/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        env[key] = value
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        proc = _launch_worker(spec_path, run_dir, env, log)
        try:
            while proc.poll() is None:
                time.sleep(0.25)
                losses, _, _ = read_losses(losses_path)
                if losses:
                    progress.update(task, completed=len(losses), loss=f"{losses[-1]:.3f}")
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    losses, times, done = read_losses(losses_path)
    progress.update(task, completed=len(losses), loss=f"{losses[-1]:.3f}" if losses else "-")
    if proc.returncode != 0 or not done or len(losses) != spec["iters"]:
        reason = _tail(run_dir / "train.log") or f"exit code {proc.returncode}"
        raise UserError(f"run {run.label} failed after {len(losses)} of {spec['iters']} iterations: {reason} "
                        f"(log: {run_dir / 'train.log'})")
    loop = times[-1] - times[0] if len(times) > 1 else 0.0
    return RunResult(run.label, losses, loop, time.time() - start)


def _launch_worker(spec_path: Path, run_dir: Path, env: dict[str, str], log: Any) -> subprocess.Popen:
    """The worker process of one run (a seam: tests may run the same worker in their own process)."""
    return subprocess.Popen([sys.executable, "-m", "bridge_ext.compare", "--worker", str(spec_path)],
                            cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--worker":
        try:
            return _worker(Path(argv[1]))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print("usage: nemo llm compare --recipes A,B --out DIR (this module's own entry is for its workers)",
          file=sys.stderr)
    return 2
