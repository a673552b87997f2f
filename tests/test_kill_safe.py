"""Kill-safe training: which iteration is complete, which one a run resumes from and export reads; a proxy run
killed at every stage of a save resumes with the losses of a straight run; SIGTERM saves and exits 0.

The kill-point test runs each killed `nemo llm pretrain` as a real process through tests/kill_driver.py, which
signals it at a chosen file write of a save; each such process is forked in a new session from a server that
imported torch and Megatron Bridge once (tests/fork_launch.py; the SIGTERM tests, where start-up is part of what
is tested, start theirs from scratch); the straight run and the exports run in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from bridge_ext import checkpoints
from bridge_ext.checkpoints import find_iteration, read_tracker, resume_point
from bridge_ext.errors import UserError
from bridge_ext.stack import common_state_inside_checkpoint, module_source
from tests.fork_launch import ForkServer
from tests.nemo_cli import start_nemo

pytestmark = pytest.mark.stack  # torch's checkpoint writer and Megatron Bridge's save: .ci/run runs these on every stack

REPO = Path(__file__).resolve().parents[1]
COMPLETE = (".metadata", "__0_0.distcp", "common.pt", "metadata.json", "train_state.pt", "run_config.yaml")


def make_iteration(root: Path, number: int, files=COMPLETE) -> Path:
    """An iteration directory with ``files``: the pickles empty but readable (a load vets them), the rest one byte."""
    path = root / f"iter_{number:07d}"
    path.mkdir(parents=True)
    for name in files:
        if name.endswith(".pt"):
            torch.save({}, path / name)
        else:
            (path / name).write_bytes(pickle.dumps(Metadata(state_dict_metadata={})) if name == ".metadata" else b"x")
    return path


def write_tracker(root: Path, number: int, *, pt: bool = True, txt: bool = True) -> None:
    if pt:  # what Megatron Bridge writes: TrainState.state_dict(), tensors
        torch.save({"step": torch.tensor(number, dtype=torch.int32)}, root / "latest_train_state.pt")
    if txt:
        (root / "latest_checkpointed_iteration.txt").write_text(str(number))


def user_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------ which iteration
def test_missing_files_names_what_a_resume_needs(tmp_path):
    assert checkpoints.missing_files(make_iteration(tmp_path, 10)) == []
    assert checkpoints.missing_files(make_iteration(tmp_path, 20, COMPLETE[:5])) == ["run_config.yaml"]
    assert checkpoints.missing_files(make_iteration(tmp_path, 30, ("common.pt", "__0_0.distcp"))) == [
        ".metadata", "metadata.json", "train_state.pt", "run_config.yaml"]
    # megatron-core 0.19 keeps the common state inside the DCP files (common.pt: older checkpoints only)
    common = [] if common_state_inside_checkpoint() else ["common.pt"]
    assert checkpoints.missing_files(make_iteration(tmp_path, 40, ())) == [
        *common, ".metadata", "metadata.json", "train_state.pt", "run_config.yaml"]
    without_common_pt = tuple(name for name in COMPLETE if name != "common.pt")
    assert checkpoints.missing_files(make_iteration(tmp_path, 45, without_common_pt)) == common
    # fsdp_dtensor: plain torch DCP, no Megatron common.pt / metadata.json
    dcp_only = make_iteration(tmp_path, 50, (".metadata", "train_state.pt"))
    assert checkpoints.missing_files(dcp_only) == ["run_config.yaml"]
    assert checkpoints.missing_files(tmp_path / "iter_0000060") == ["the directory"]


def test_resume_point_follows_the_tracker_and_falls_back_to_the_newest_complete(tmp_path):
    assert resume_point(tmp_path) == checkpoints.ResumePoint(None, None)  # nothing saved yet: from scratch
    for n in (10, 20):
        make_iteration(tmp_path, n)
    make_iteration(tmp_path, 30, COMPLETE[:5])  # killed after the trackers, before run_config.yaml
    make_iteration(tmp_path, 40)  # complete but never committed: the tracker is the commit point
    write_tracker(tmp_path, 20)
    assert resume_point(tmp_path) == checkpoints.ResumePoint(20, 20)
    write_tracker(tmp_path, 30)
    point = resume_point(tmp_path)
    assert (point.iteration, point.tracker, point.overrides_tracker) == (20, 30, True)
    assert point.note == (f"iteration 30 in {tmp_path} is incomplete (missing run_config.yaml); "
                          "using iteration 20, the newest complete one")
    # Megatron Bridge reads latest_train_state.pt first; the text tracker is Megatron-LM's
    write_tracker(tmp_path, 10, txt=False)
    assert resume_point(tmp_path).iteration == 10
    (tmp_path / "latest_train_state.pt").write_bytes(b"cut short")
    assert read_tracker(tmp_path) == (30, f"{tmp_path / 'latest_train_state.pt'} is unreadable (UnpicklingError)")


def test_resume_point_refuses_when_nothing_complete_is_left(tmp_path):
    make_iteration(tmp_path, 10, COMPLETE[:4])
    write_tracker(tmp_path, 10)
    message = user_error(resume_point, tmp_path)
    assert message == (f"iteration 10 in {tmp_path} is incomplete (missing train_state.pt, run_config.yaml) and "
                       f"no earlier iteration is complete; nothing to resume from (move {tmp_path} away to start "
                       "afresh)")


def test_export_picks_what_training_resumes_from(tmp_path):
    for n in (2, 10):
        make_iteration(tmp_path, n)
    make_iteration(tmp_path, 12, COMPLETE[1:3])  # a save interrupted after its data files
    write_tracker(tmp_path, 12)
    assert find_iteration(tmp_path) == (tmp_path / "iter_0000010", 10)
    assert find_iteration(tmp_path, 2) == (tmp_path / "iter_0000002", 2)
    assert find_iteration(tmp_path / "iter_0000002") == (tmp_path / "iter_0000002", 2)
    assert user_error(find_iteration, tmp_path, 12) == (
        f"--iteration 12 in {tmp_path} is incomplete (missing .metadata, metadata.json, train_state.pt, "
        "run_config.yaml); complete: 2, 10")
    assert user_error(find_iteration, tmp_path, 5) == f"--iteration 5 not found in {tmp_path}; available: 2, 10"
    assert user_error(find_iteration, tmp_path / "iter_0000012").startswith(
        f"--ckpt {tmp_path / 'iter_0000012'} is incomplete (missing .metadata, metadata.json")
    for name in ("latest_train_state.pt", "latest_checkpointed_iteration.txt"):
        (tmp_path / name).unlink()
    assert user_error(find_iteration, tmp_path) == (
        f"--ckpt {tmp_path} has no tracker (latest_train_state.pt or latest_checkpointed_iteration.txt): no save "
        "finished, a run would start from scratch; pass --iteration N to export a complete one (2, 10)")


def test_training_loads_the_resume_point_and_refuses_incomplete_choices(tmp_path):
    from types import SimpleNamespace

    from bridge_ext.kill_safe import prepare_resume

    def config(**checkpoint):
        fields = dict(load=str(tmp_path / "run"), save=str(tmp_path / "run"), ckpt_step=None,
                      pretrained_checkpoint=None)
        return SimpleNamespace(checkpoint=SimpleNamespace(**{**fields, **checkpoint}))

    run = tmp_path / "run"
    assert prepare_resume(config()) is None  # nothing saved yet
    make_iteration(run, 2)
    make_iteration(run, 4, COMPLETE[:5])
    write_tracker(run, 2)
    cfg = config()
    unrecorded = (f"integrity: {run / 'iter_0000002'} has no integrity record (saved without bridge_ext or with "
                  "--no-checksums); its files' sizes were checked against .metadata, their contents were not")
    assert prepare_resume(cfg) == unrecorded and cfg.checkpoint.ckpt_step is None  # Megatron Bridge reads the tracker
    write_tracker(run, 4)
    assert prepare_resume(cfg) == (f"resume: iteration 4 in {run} is incomplete (missing run_config.yaml); using "
                                   f"iteration 2, the newest complete one\n{unrecorded}")
    assert cfg.checkpoint.ckpt_step == 2  # how Megatron Bridge is told to load another iteration
    assert user_error(prepare_resume, config(ckpt_step=4)) == (
        f"checkpoint.ckpt_step=4: iteration 4 in {run} is incomplete (missing run_config.yaml)")
    fresh = config(load=str(tmp_path / "new"), save=str(tmp_path / "new"), pretrained_checkpoint=str(run))
    assert user_error(prepare_resume, fresh) == (
        f"checkpoint.pretrained_checkpoint: iteration 4 in {run} is incomplete (missing run_config.yaml); Megatron "
        "Bridge loads only the iteration its tracker names")


def test_a_changed_save_function_is_refused(monkeypatch):
    import dataclasses

    from bridge_ext import patches
    from bridge_ext.patches import registry
    from bridge_ext.stack import UpstreamDrift

    patch = next(p for p in patches.REGISTRY if p.name == "atomic-checkpoint-save")
    assert patches.problems(patch) == []  # the installed Megatron Bridge has every line the wrapper relies on
    changed = dataclasses.replace(patch, name="atomic-checkpoint-save (changed)",
                                  snippets=(*patch.snippets, "write_tracker_last(save_dir)"))
    monkeypatch.setattr(registry, "REGISTRY", (changed,))
    with pytest.raises(UpstreamDrift, match="checkpointing no longer contains 'write_tracker_last"):
        patches.apply("checkpointing")


# ---------------------------------------------------------------------------------------- kill-point test
KILL_ENV = {"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def run_killed(tmp: Path, argv: list[str], *, events: tuple[dict, ...] = (), server: ForkServer | None = None) -> dict:
    """``nemo *argv`` as a real process (tests/kill_driver.py) that signals itself at ``events``: ``{"status":
    exit code or -signal, "fired": [...], "survivors": [...], "seconds": s, "log": text}``; ``survivors``:
    processes of its session still alive 20 s after it ended (zombies are dead and do not count). ``server``
    (a :class:`ForkServer` started with ``KILL_ENV``): the process is forked from it, its imports done; else
    started from scratch. Either way it is a new session whose helpers stay in it."""
    log = tmp / f"run-{time.monotonic_ns()}.log"
    driver = [REPO / "tests" / "kill_driver.py", json.dumps(list(events))]
    start = time.monotonic()
    if server is not None:
        pid, status = server.run(driver[0], [*driver[1:], *argv], cwd=tmp, log=log)
    else:
        with log.open("w") as out:
            proc = start_nemo(argv, driver=driver, cwd=tmp, env=KILL_ENV, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
            pid, status = proc.pid, proc.wait(timeout=900)
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 20
    while (survivors := session_processes(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    fired = [json.loads(line.split("FIRED ", 1)[1]) for line in text.splitlines() if line.startswith("FIRED ")]
    return {"status": status, "fired": fired, "survivors": survivors, "seconds": round(seconds, 2), "log": text}


def session_processes(sid: int) -> list[str]:
    """Live processes of session ``sid``: ``"pid: command line"``."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    dead = f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, waiting for its parent to reap it
                if os.getsid(int(entry)) == sid and not dead:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        alive.append(f"{entry}: {f.read().replace(b'\0', b' ').decode(errors='replace')[:200]}")
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return alive


def running(pid: int) -> bool:
    """Whether process ``pid`` is alive (not exited, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def losses(path: Path, skip: int = 0) -> list[tuple[int, float]]:
    """(iteration, loss) records of losses.jsonl after its first ``skip`` lines."""
    lines = path.read_text().splitlines()[skip:] if path.exists() else []
    return [(r["iteration"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


ITERS, INTERVAL, KEEP = 10, 2, 2
# (what the kill leaves behind, the driver's events, the iteration training then resumes from)
# The first file of a save: megatron-core 0.16-0.18 write the common state to common.pt first; 0.19 keeps it inside
# the DCP data files, so the first write is torch's __0_0.distcp
FIRST_WRITE = "__0_0.distcp" if common_state_inside_checkpoint() else "common.pt"
KILLS = (
    ("iteration 2 committed, killed as iteration 3 starts", ({"step": 3, "signal": "KILL"},), 2),
    ("iter_0000004 created, nothing in it", ({"before": FIRST_WRITE, "iteration": 4, "signal": "KILL"},), 2),
    ("common state and data files written", ({"before": ".metadata", "iteration": 4, "signal": "KILL"},), 2),
    ("torch DCP .metadata written", ({"before": "metadata.json", "iteration": 4, "signal": "KILL"},), 2),
    ("Megatron metadata.json written", ({"before": "train_state.pt", "iteration": 4, "signal": "KILL"},), 2),
    ("iteration train state written", (
        {"before": ".commit.latest_train_state.pt", "iteration": 4, "signal": "KILL"},), 2),
    ("trackers written (upstream: before run_config.yaml)", (
        {"before": "run_config.yaml", "iteration": 4, "signal": "KILL"},), 2),
    ("run_config.yaml written, tokenizer files not", (  # transformers 5 writes tokenizer.json in Rust: no audit event
        {"before": "tokenizer/", "iteration": 4, "signal": "KILL"},), 2),
    ("latest_train_state.pt moved to 4, latest_checkpointed_iteration.txt not", (
        {"before": "latest_checkpointed_iteration.txt", "iteration": 4, "signal": "KILL"},), 4),
    ("SIGTERM in iteration 5, a second one during its save: saved, exit 0", (
        {"step": 5, "signal": "TERM"}, {"before": FIRST_WRITE, "iteration": 5, "signal": "TERM"}), 5),
    ("SIGTERM in iteration 7, SIGKILL during its save (before run_config.yaml)", (
        {"step": 7, "signal": "TERM"}, {"before": "run_config.yaml", "iteration": 7, "signal": "KILL"}), 6),
)


@pytest.fixture(scope="module")
def kill_server():
    """The real runs' fork server (tests/fork_launch.py): each run a forked process in its own session, the imports
    done once for the module's killed and signalled runs."""
    with ForkServer(env=KILL_ENV) as server:
        yield server


@pytest.mark.slow
@pytest.mark.heavy
def test_killed_at_every_stage_of_a_save_resumes_exactly(nemo, tmp_path, kill_server):
    """qwen3_proxy_muon, 10 iterations, a save every 2, keeping 2: one straight run (in this process), then the
    same command run again and again as a real process, each killed at another moment (KILLS); each rerun
    resumes where training and export say it does, with the straight run's losses bit for bit; no helper
    process outlives a run; `nemo llm export` at the point where upstream's own save leaves an unloadable
    iteration."""
    def command(run: Path) -> list[str]:
        return ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", f"checkpoint.save={run}", f"checkpoint.load={run}",
                f"train.train_iters={ITERS}", f"checkpoint.save_interval={INTERVAL}",
                f"checkpoint.most_recent_k={KEEP}"]

    def pretrain(run: Path, *, events=()):
        return run_killed(tmp_path, command(run), events=events, server=kill_server)

    start = time.monotonic()
    straight = nemo(command(tmp_path / "straight"), cwd=tmp_path)
    log = straight.stdout + straight.stderr
    assert straight.code == 0, log[-3000:]
    assert "on SIGTERM: finishes the current iteration, saves a checkpoint to" in log
    # pretrain()'s second save of the step the loop saved: skipped, where the installed pretrain() makes one
    assert (f"iteration {ITERS} is already saved in" in log) == _pretrain_saves_after_the_loop()
    reference = dict(losses(tmp_path / "straight" / "losses.jsonl"))
    assert sorted(reference) == list(range(1, ITERS + 1))

    run, record = tmp_path / "run", tmp_path / "run" / "losses.jsonl"
    resumed_from, timings = 0, [("straight run (in this process)", round(time.monotonic() - start, 2))]
    for what, events, resumes in KILLS:
        skip = len(record.read_text().splitlines()) if record.exists() else 0
        result = pretrain(run, events=events)
        assert result["fired"] == list(events), (what, result["log"][-3000:])
        stopped_by_term = events[-1]["signal"] == "TERM"
        assert result["status"] == (0 if stopped_by_term else -9), (what, result["log"][-3000:])
        assert result["survivors"] == [], what
        got = losses(record, skip)
        assert got[0][0] == resumed_from + 1, what  # resumed where the previous kill said it would
        assert all(loss == reference[it] for it, loss in got), (what, got)
        if stopped_by_term:
            assert f"stopped on SIGTERM at iteration {resumes}, saved to {run}" in result["log"]
        assert find_iteration(run)[1] == resumes, what  # export reads what the next run will load
        if events[0].get("before") == "run_config.yaml":
            check_export(nemo, run, tmp_path)
        resumed_from = resumes
        timings.append((what, result["seconds"]))

    # The upstream failure, as a save without bridge_ext.kill_safe leaves it: iteration 6 is the tracker's
    # but has no run_config.yaml. The run falls back to 5, says so, and finishes.
    assert read_tracker(run)[0] == 6
    (run / "iter_0000006" / "run_config.yaml").unlink()
    assert find_iteration(run)[1] == 5
    skip = len(record.read_text().splitlines())
    last = pretrain(run)
    assert last["status"] == 0 and last["survivors"] == [], last["log"][-3000:]
    assert (f"resume: iteration 6 in {run} is incomplete (missing run_config.yaml); using iteration 5, the newest "
            "complete one") in last["log"]
    got = losses(record, skip)
    assert [it for it, _ in got] == list(range(6, ITERS + 1))
    assert all(loss == reference[it] for it, loss in got), got
    assert read_tracker(run)[0] == ITERS
    assert sorted(checkpoints.iterations(run)) == [8, 10]  # most_recent_k=2, applied after each commit
    assert sorted(checkpoints.iterations(tmp_path / "straight")) == [8, 10]
    timings.append(("fallback run to the end", last["seconds"]))
    print("\n".join(f"{seconds:6.1f} s  {what}" for what, seconds in timings))


def _pretrain_saves_after_the_loop() -> bool:
    """Whether the installed ``pretrain()`` saves once more after ``train()`` returns: megatron-bridge 0.3's
    pretrain.py does, also for the step the loop's interval just saved; 0.4+ saves a last step only in train.py,
    where the interval did not."""
    import ast

    tree = ast.parse(module_source("megatron.bridge.training.pretrain"))
    return any(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "save_checkpoint"
               for node in ast.walk(tree))


def check_export(nemo, run: Path, tmp_path: Path) -> None:
    """Killed after the trackers, before run_config.yaml (where Megatron Bridge's own save leaves an iteration
    no restart can load): export takes the committed iteration and refuses the unfinished one in one line."""
    names = set(os.listdir(run / "iter_0000004"))
    assert {".metadata", FIRST_WRITE, "metadata.json", "train_state.pt", ".commit.latest_train_state.pt",
            ".commit.latest_checkpointed_iteration.txt"} <= names and "run_config.yaml" not in names, names
    assert read_tracker(run)[0] == 2  # upstream alone would say 4 here
    refused = nemo(["llm", "export", "--ckpt", run, "--iteration", "4", "--out", tmp_path / "x"])
    assert refused.code == 2
    assert (f"error: --iteration 4 in {run} is incomplete (missing run_config.yaml); complete: 2"
            in refused.stderr.splitlines())
    assert not (tmp_path / "x").exists()
    exported = nemo(["llm", "export", "--ckpt", run, "--out", tmp_path / "hf"])
    assert exported.code == 0, exported.stderr[-3000:]
    assert f"iteration 2 from {run / 'iter_0000002'}" in exported.stdout + exported.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["setting up", "training"])
def test_sigterm_to_every_process_stops_the_run_with_a_save(tmp_path, moment, kill_server):
    """As Slurm signals a job step (its time limit, `scancel --signal=TERM`): SIGTERM to the command's whole
    process group, helpers included. "setting up": from the "CPU mode" line until the first loss is recorded,
    every 50 ms (whatever starts meanwhile gets it: the checkpoint writer's Manager, spawned, before its
    initializer ran, killed the run this way under Slurm): held until training starts, the run stops after
    iteration 1. "training": once iteration 2 is recorded (the Manager and its resource tracker are running).
    Either way the run saves, exits 0, and no process of it outlives it. The run is forked from the module's
    server (its imports done; a new session, as ``start_new_session``), the test following its log."""
    import threading

    spraying = threading.Event()

    def spray():
        while spraying.is_set():
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            if losses(run / "losses.jsonl"):
                return
            time.sleep(0.05)

    run, log = tmp_path / "run", tmp_path / "run.log"
    argv = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "train.train_iters=200", "logger.log_interval=1",
            f"checkpoint.save={run}", f"checkpoint.load={run}"]
    pid = kill_server.start(REPO / "tests" / "kill_driver.py", ["[]", *argv], cwd=tmp_path, log=log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and running(pid):  # until the moment comes (or the run ends)
        text = log.read_text() if log.exists() else ""
        if moment == "setting up" and any(line.startswith("CPU mode:") for line in text.splitlines()):
            spraying.set()
            threading.Thread(target=spray, daemon=True).start()
            break
        if moment == "training" and len(losses(run / "losses.jsonl")) >= 2:
            os.killpg(pid, signal.SIGTERM)
            break
        time.sleep(0.02)
    status = kill_server.wait(pid)
    spraying.clear()
    text = log.read_text()
    assert status == 0, text[-3000:]
    stopped = int(re.search(rf"stopped on SIGTERM at iteration (\d+), saved to {run}", text).group(1))
    assert stopped == 1 if moment == "setting up" else 2 <= stopped < 200, text[-3000:]
    assert [it for it, _ in losses(run / "losses.jsonl")] == list(range(1, stopped + 1))
    assert read_tracker(run)[0] == stopped
    deadline = time.monotonic() + 20
    while session_processes(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes(pid) == []


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.once  # the lock is ours (flock on a file): no stack code between the run and it
def test_a_second_writer_is_refused_and_a_killed_runs_lock_never_blocks_its_resume(nemo, tmp_path, kill_server):
    """Issue 50: a run training into ``checkpoint.save`` (a real process, forked from the module's server) holds
    the directory; the same command started beside it is refused in one line naming the holder's host and pid
    (Slurm job where there is one) and writes nothing (the holder is paused with SIGSTOP meanwhile, so any
    change to the directory is the second run's). SIGKILLed, the holder leaves its lock file behind, and the
    same command resumes from the last complete save and finishes."""
    import socket

    run, log = tmp_path / "run", tmp_path / "run.log"
    argv = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "train.train_iters=12", "logger.log_interval=1",
            "checkpoint.save_interval=2", f"checkpoint.save={run}", f"checkpoint.load={run}"]
    pid = kill_server.start(REPO / "tests" / "kill_driver.py", ["[]", *argv], cwd=tmp_path, log=log)
    deadline = time.monotonic() + 300
    while len(losses(run / "losses.jsonl")) < 3:  # past its first save (iteration 2)
        assert running(pid) and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    os.killpg(pid, signal.SIGSTOP)
    try:
        before = _tree(run)
        second = nemo(argv, cwd=tmp_path)
        assert _tree(run) == before  # nothing written, nothing removed
    finally:
        os.killpg(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    assert kill_server.wait(pid) == -signal.SIGKILL
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.code == 2 and "Traceback" not in second.stderr and len(errors) == 1, second.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint.save {run.resolve()} is being written by another run "
                                f"(host {socket.gethostname()}, pid {pid}, since "), errors[0]
    assert errors[0].endswith("wait for it to end, or point checkpoint.save at another directory"), errors[0]

    saved = read_tracker(run)[0]
    assert saved is not None and 2 <= saved < 12 and (run / ".writer.lock").exists()  # the dead run's file stays
    recorded = len((run / "losses.jsonl").read_text().splitlines())
    resumed = nemo(argv, cwd=tmp_path)
    assert resumed.code == 0, resumed.stderr[-3000:]
    assert read_tracker(run)[0] == 12
    # from the last complete save to the end: nothing lost, nothing before it trained again
    assert [it for it, _ in losses(run / "losses.jsonl", skip=recorded)] == list(range(saved + 1, 13))


@pytest.mark.slow
@pytest.mark.once  # the hold and its bound are ours (a signal handler and a timer thread): no stack code in them
def test_a_sigterm_held_during_a_start_up_that_never_trains_ends_it_within_the_bound(tmp_path, kill_server):
    """Issue 50: a start-up that never reaches training (tests/kill_driver.py's ``hang``: Megatron Bridge's
    ``pretrain()`` replaced by a loop, as megatron-core's GPTDataset spun on an empty split) held SIGTERM for
    ever. With the bound at 3 s (``BRIDGE_EXT_STARTUP_GRACE_S``), one SIGTERM ends it 3 s later: one line,
    exit 143, nothing saved, no process of it left."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    argv = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", f"checkpoint.save={run}", f"checkpoint.load={run}"]
    events = json.dumps([{"hang": "before training"}])
    pid = kill_server.start(REPO / "tests" / "kill_driver.py", [events, *argv], cwd=tmp_path, log=log,
                            env={"BRIDGE_EXT_STARTUP_GRACE_S": "3"})
    deadline = time.monotonic() + 300
    while "HANGING before training" not in (log.read_text() if log.exists() else ""):
        assert running(pid) and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    signalled = time.monotonic()
    os.killpg(pid, signal.SIGTERM)
    status = kill_server.wait(pid)
    waited = time.monotonic() - signalled
    text = log.read_text()
    assert status == 128 + signal.SIGTERM, text[-3000:]
    assert 3 <= waited < 30, waited
    assert text.rstrip().splitlines()[-1] == ("SIGTERM came during start-up and training had not started 3 s "
                                              "later: the run ends, nothing saved"), text[-3000:]
    assert "Traceback" not in text and not list(run.glob("iter_*")) and read_tracker(run)[0] is None
    deadline = time.monotonic() + 20
    while session_processes(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes(pid) == []


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of ``size`` (``32m``, ``64k``) mounted at ``where`` (root: CI runs the suite as root), unmounted
    after."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_same_command_resumes(nemo, tmp_path):
    """Issue 50: ``checkpoint.save`` on a 32 MiB tmpfs. A run saves iteration 1 (its size measured: S); the disk is
    then filled to 1.5 S free, so the same command, resumed to 3, warns that only one save fits, saves 2, and
    fails at the save of 3 (torch's writer says "unexpected pos", not ENOSPC): one line naming the filesystem, the
    room, the last complete save; the trackers still name 2. Space freed, the same command resumes from 2 and
    finishes."""
    import shutil

    from bridge_ext.checkpoints.disk_space import tree_bytes

    with small_disk(tmp_path / "disk", "32m") as disk:
        run = disk / "run"
        argv = ["llm", "pretrain", "--recipe", "qwen3_proxy_muon", "logger.log_interval=1",
                "checkpoint.save_interval=1", f"checkpoint.save={run}", f"checkpoint.load={run}"]
        first = nemo([*argv, "train.train_iters=1"], cwd=tmp_path)
        assert first.code == 0 and read_tracker(run)[0] == 1, first.stderr[-3000:]
        one_save = tree_bytes(run / "iter_0000001")
        assert "save fits" not in first.stderr  # 32 MiB holds more than two
        (disk / "filler").write_bytes(b"\0" * int(shutil.disk_usage(disk).free - 1.5 * one_save))

        full = nemo([*argv, "train.train_iters=3"], cwd=tmp_path)
        warning = re.search(r"^warning: checkpoint\.save .* and a save takes about ([\d.]+) MiB: only 1 save fits; ",
                            full.stderr, re.M)
        assert warning, full.stderr[-3000:]
        assert abs(float(warning.group(1)) * 2**20 / one_save - 1) < 0.35, (warning.group(1), one_save)  # ~
        errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
        assert full.code == 2 and "Traceback" not in full.stderr and len(errors) == 1, full.stderr[-3000:]
        assert errors[0].startswith(f"error: the checkpoint save of iteration 3 into {run} failed: no space left on "
                                    f"{disk} ("), errors[0]
        saved = tree_bytes(run / "iter_0000002")
        assert errors[0].endswith(f"free; a save takes {saved / 2**20:.1f} MiB); the last complete save is "
                                  "iteration 2; free space and run the same command to resume"), errors[0]
        assert read_tracker(run)[0] == 2
        recorded = len((run / "losses.jsonl").read_text().splitlines())

        (disk / "filler").unlink()
        resumed = nemo([*argv, "train.train_iters=3"], cwd=tmp_path)
        assert resumed.code == 0 and read_tracker(run)[0] == 3, resumed.stderr[-3000:]
        assert [it for it, _ in losses(run / "losses.jsonl", skip=recorded)] == [3]


@pytest.mark.slow
def test_a_full_disk_under_import_and_prepare_data_is_one_line_and_keeps_nothing(nemo, tmp_path):
    """Issue 50: ``nemo llm import --out`` and ``prepare-data --out`` on a 64 KiB tmpfs, each output larger than
    that: one line naming the output and the filesystem, exit 2, and nothing left on it (the staged output and
    the partial dataset removed)."""
    import hf_fixtures

    from bridge_ext.data import PROXY_TOKENIZER_DIR

    hf = hf_fixtures.qwen3_dir(tmp_path / "hf")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p.read_text()}) + "\n"
                              for p in sorted(Path(os.__file__).parent.glob("*.py"))[:20]))
    with small_disk(tmp_path / "disk", "64k") as disk:
        for out, argv in ((disk / "imported", ["llm", "import", "--hf", str(hf), "--out", str(disk / "imported")]),
                          (disk / "corpus", ["llm", "prepare-data", "--input", str(corpus), "--tokenizer",
                                             str(PROXY_TOKENIZER_DIR), "--out", str(disk / "corpus")])):
            done = nemo(argv, cwd=tmp_path)
            errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
            assert done.code == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
            assert re.fullmatch(rf"error: writing {re.escape(str(out))} failed: no space left on {re.escape(str(disk))}"
                                r" \([\d.]+ (B|KiB) free\); nothing of it is kept; free space and run the same "
                                r"command again", errors[0]), errors[0]
            assert list(disk.iterdir()) == [], sorted(disk.iterdir())


def test_an_exit_signal_after_training_ended_is_noted_not_fatal(capsys):
    """Slurm's time-limit signal comes from a sweep every 30 s: it can land after the last iteration, while the run
    tears down (job 205 of the Slurm test: trained and saved, then died of SIGTERM with 143, the job FAILED, nothing
    requeued). Under the command's hold (``held_exit_signal``) the run's own handler (upstream's
    ``DistributedSignalHandler``, installed by ``graceful_stop``) hands the signal back to the hold when training
    ends, not to the handler from before the command: the signal is noted, said in one line, and not delivered."""
    from types import SimpleNamespace

    from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler

    from bridge_ext.kill_safe import graceful_stop, held_exit_signal

    delivered = []  # stands in for the default action (the process would die of it)
    before = signal.signal(signal.SIGTERM, lambda signum, frame: delivered.append(signum))
    try:
        with held_exit_signal():
            stop = graceful_stop()
            train = SimpleNamespace(exit_signal_handler=True)
            context = SimpleNamespace(state=SimpleNamespace(cfg=SimpleNamespace(train=train),
                                                            signal_handler=DistributedSignalHandler(signal.SIGTERM)))
            stop.on_train_start(context)
            stop.on_train_step_end(context)
            stop.release()  # training ended (run_pretrain's finally)
            signal.raise_signal(signal.SIGTERM)
            assert delivered == [] and not stop.came  # noted, not delivered; the run was not told to stop
        assert delivered == []
        assert "SIGTERM came after training ended: nothing left to stop\n" in capsys.readouterr().err
        signal.raise_signal(signal.SIGTERM)  # the command returned: the handler from before it is back
        assert delivered == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


# Megatron Bridge's own pretrain() after prepare_for_this_machine (README, "Python API"): no bridge_ext code runs
# between the two, so the checkpoint writer's Manager is whatever the checkpointing patches make it at the first save
API_TRAINER = """\
import sys

from bridge_ext.api import prepare_for_this_machine, recipe_config
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.training.pretrain import pretrain

if __name__ == "__main__":  # the writer's Manager is spawned: it imports this file again
    cfg = recipe_config(sys.argv[1], overrides=sys.argv[2:])
    pretrain(cfg, forward_step, callbacks=prepare_for_this_machine(cfg, device="cpu", data="mock"))
"""


@pytest.mark.slow
@pytest.mark.once  # ~50 s; the writer's Manager per stack: tests/prove_patches.py runs it with the row off there
def test_sigkilled_trainer_leaves_no_checkpoint_writer_process_behind(tmp_path):
    """A trainer killed with SIGKILL after its first torch_dist save takes every process of its session with it:
    megatron-core's writer starts a Manager server (and a resource tracker) at that save, which outlived the
    trainer until the ``checkpoint-writer-dies-with-trainer`` patch started it with PR_SET_PDEATHSIG. The run is the
    Python API's (Megatron Bridge's own ``pretrain()``): ``nemo llm pretrain`` starts that server itself before
    training (``kill_safe.keep_helpers_with_trainer``), where the patch alone would not show."""
    run, script, log = tmp_path / "run", tmp_path / "train.py", tmp_path / "train.log"
    script.write_text(API_TRAINER)
    with log.open("w") as out:  # the trainer is this process itself: one CPU process, no torchrun
        proc = start_nemo(["qwen3_proxy_muon", "train.train_iters=50", "checkpoint.save_interval=1",
                           f"checkpoint.save={run}"], driver=[script], cwd=tmp_path,
                          env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}, stdout=out,
                          stderr=subprocess.STDOUT, start_new_session=True)  # its helpers stay in its session
    try:
        deadline = time.monotonic() + 300
        while read_tracker(run)[0] is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_tracker(run)[0] is not None and proc.poll() is None, log.read_text()[-3000:]  # saved, training on
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 15
        while (survivors := session_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert survivors == [], "outlived the SIGKILLed trainer:\n" + "\n".join(survivors)
    finally:  # nothing of the run is left behind, whatever failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for line in session_processes(proc.pid):  # one that left the process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        proc.wait(timeout=30)
