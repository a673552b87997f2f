"""Kill-safe training: a run stopped at any moment resumes.

* Atomic saves (:func:`atomic_save_checkpoint` and its helpers, installed by the ``atomic-checkpoint-*``
  patches of ``bridge_ext.patches.checkpointing``, one per upstream attribute): Megatron Bridge 0.3's ``save_checkpoint``
  (``training/checkpointing.py``) writes the trackers ``latest_train_state.pt`` and
  ``latest_checkpointed_iteration.txt`` inside its nested ``train_state_finalize_fn`` *before*
  ``cfg.to_yaml(config_filename)`` writes ``run_config.yaml`` and before the tokenizer files; a run killed in
  between names an iteration it can never load. Around that function we let it write the two trackers into the
  iteration directory instead, and move them into place (``os.replace``) only once every file of the iteration
  is there and flushed.
* :func:`prepare_resume`: the iteration a run loads (``bridge_ext.checkpoints.resume_point``), said in one line
  when it is not the one the tracker names, checked before anything reads it (its pickles vetted, its files and
  checksums verified: ``bridge_ext.checkpoints.pickles``, ``integrity``).
* Integrity records (:func:`record_integrity`): after a save every rank records the sizes and CRC-32s of the files it
  wrote (``bridge_ext.checkpoints.integrity``), before the trackers move.
* :func:`graceful_stop`: Megatron Bridge polls ``state.signal_handler`` when ``train.exit_signal_handler`` is on
  (``train.py``, ``checkpoint_and_decide_exit``) but never installs it (``DistributedSignalHandler.__enter__``
  is called nowhere for the trainer); this callback installs it when training starts.
* :func:`held_exit_signal`: from the command's start until training starts, the exit signal is noted instead of
  killing the process (Slurm's time-limit SIGTERM or a preemption can come while the run imports, builds or
  loads); :func:`graceful_stop` then stops the run after its first iteration, with a save. A start-up that has
  not reached training ``STARTUP_GRACE_S`` after the signal (300 s; ``BRIDGE_EXT_STARTUP_GRACE_S``) ends there,
  in one line, nothing saved, exit 128 + the signal (before, a start-up that never ended ignored it). After
  training ends it is noted again until the command returns: Slurm's time-limit signal comes from a sweep every
  30 s, so it can land after the last iteration, while the run tears down; the run has finished and saved, and it
  exits 0 saying so (before, it died of the signal with 143 and the job ended FAILED, not requeued).
* :func:`keep_helpers_with_trainer`: helper processes of a save die with the trainer, even on SIGKILL.

Top-level imports stay light: the helper processes import this module to run :func:`exit_with_parent`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_ext.runtime import publish, write_atomic

__all__ = ["atomic_save_checkpoint", "commit_after_async_save", "deferred_cleanup", "exit_with_parent",
           "graceful_stop", "held_exit_signal", "keep_helpers_with_trainer", "prepare_resume", "record_integrity",
           "staged_tracker", "start_results_server", "stop_line"]


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _say(line: str) -> None:
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)


@dataclass
class _Save:
    """One persistent save in progress (``save_checkpoint`` is running or its async part is queued)."""

    save_dir: str
    iteration: int
    staged: dict[str, str] = field(default_factory=dict)  # tracker path -> where upstream wrote it this time
    keep: int | None = None  # most_recent_k, applied once the save is committed
    is_async: bool = False

    @property
    def iter_dir(self) -> str:
        from bridge_ext.checkpoints import iteration_dir

        return str(iteration_dir(self.save_dir, self.iteration))


_active: _Save | None = None
_saved: set[tuple[str, int]] = set()  # (save dir, iteration) this process saved or resumed from
_integrity = {"record": True}  # whether saves write an integrity record (--no-checksums: not)


def record_integrity(enabled: bool) -> None:
    """Whether this process's saves write their integrity record (``--no-checksums`` turns it off)."""
    _integrity["record"] = enabled


def _same_dir(path: str, save: _Save | None) -> bool:
    return save is not None and os.path.realpath(path) == os.path.realpath(save.save_dir)


# ------------------------------------------------------------------------------------------- atomic save
def staged_tracker(path: str, checkpoints_path: str) -> str:
    """During a save, the trackers of its directory are written next to the iteration's files instead."""
    if not _same_dir(checkpoints_path, _active):
        return path  # loading, or a save this module does not handle
    staged = os.path.join(_active.iter_dir, f".commit.{os.path.basename(path)}")
    _active.staged[path] = staged
    return staged


def atomic_save_checkpoint(original):
    """``save_checkpoint`` whose persistent saves commit their trackers only once the iteration is complete."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        global _active
        arguments = signature.bind(*args, **kwargs).arguments
        state = arguments["state"]
        ckpt_cfg = state.cfg.checkpoint
        if arguments.get("non_persistent_ckpt") or not ckpt_cfg.save or _active is not None or \
                "://" in str(ckpt_cfg.save):
            return original(*args, **kwargs)  # non-persistent saves keep their own tracker; object stores no rename
        save = _Save(save_dir=str(ckpt_cfg.save), iteration=int(state.train_state.step))
        key = (os.path.realpath(save.save_dir), save.iteration)
        if key in _saved:  # pretrain() saves again after the loop's save of the same step (pretrain.py)
            _say(f"iteration {save.iteration} is already saved in {save.save_dir}; not saving it again")
            return None
        if _rank() == 0:
            _uncommit(save)
        _active = save
        try:
            try:
                result = original(*args, **kwargs)
            finally:
                _active = None
            if not save.is_async:
                _write_record(save)
                _commit(save)
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            from bridge_ext.checkpoints.disk_space import no_space_error

            full = no_space_error(save.save_dir, save.iteration, exc)
            if full is None:
                raise
            raise full from None  # the trackers still name the last complete save
        _saved.add(key)
        return result

    return save_checkpoint


def commit_after_async_save(original):
    """``schedule_async_save`` that commits an async save after upstream's finalize functions."""
    @functools.wraps(original)
    def schedule_async_save(global_state: Any, async_request: Any) -> Any:
        if _active is not None:  # commit after upstream's finalize functions (metadata.json, trackers, config)
            save, _active.is_async = _active, True
            async_request.add_finalize_fn(lambda: (_write_record(save), _commit(save)))
        return original(global_state, async_request)

    return schedule_async_save


def deferred_cleanup(original):
    """``cleanup_old_non_persistent_checkpoint`` that leaves most_recent_k to the commit of the new iteration."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def cleanup(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        if _same_dir(str(arguments.arguments["save_dir"]), _active):
            # most_recent_k: upstream deletes before the new iteration is committed, and counts unfinished ones
            _active.keep = int(arguments.arguments["leave_ckpt_num"])
            return None
        return original(*args, **kwargs)

    return cleanup


def _uncommit(save: _Save) -> None:
    """Before rewriting the iteration the tracker names (a rewound run), point the tracker at the one before."""
    from bridge_ext.checkpoints import TRACKER_PT, TRACKER_TXT, is_complete, iteration_dir, iterations, read_tracker

    if read_tracker(save.save_dir)[0] != save.iteration or not os.path.isdir(save.iter_dir):
        return
    root = Path(save.save_dir)
    older = [n for n, path in iterations(root).items() if n < save.iteration and is_complete(path)]
    if not older:
        for name in (TRACKER_PT, TRACKER_TXT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(root / name)
        _fsync(root)
        return
    write_atomic(root / TRACKER_PT, (iteration_dir(root, older[-1]) / "train_state.pt").read_bytes(), fsync=True)
    write_atomic(root / TRACKER_TXT, str(older[-1]), fsync=True)
    _fsync(root)


def _write_record(save: _Save) -> None:
    """Every rank: the integrity record of the files it wrote, between two barriers (``.metadata``, which names
    the items, is complete before; every rank's record is there before rank 0 commits)."""
    if _integrity["record"]:
        from bridge_ext.checkpoints.integrity import record_save

        record_save(save.iter_dir)


def _commit(save: _Save) -> None:
    """Rank 0: flush the iteration, then move its trackers into place; then apply most_recent_k."""
    from bridge_ext.checkpoints import missing_files
    from bridge_ext.checkpoints.integrity import RECORD_DIR

    if _rank() != 0:
        return
    missing = missing_files(save.iter_dir)
    if _integrity["record"] and not os.path.isdir(os.path.join(save.iter_dir, RECORD_DIR)):
        missing.append(RECORD_DIR)
    missing += [os.path.basename(p) for p in save.staged.values() if not os.path.exists(p)]
    if missing or not save.staged:
        raise RuntimeError(f"the save of iteration {save.iteration} left {save.iter_dir} without "
                           f"{', '.join(missing) or 'its trackers'}; it is not marked as the latest checkpoint")
    for directory, _, files in os.walk(save.iter_dir):
        for name in files:
            if not name.endswith(".distcp"):  # data files: each writer fsyncs its own (filesystem_async, use_fsync)
                _fsync(os.path.join(directory, name))
        _fsync(directory)
    for tracker, staged in save.staged.items():  # latest_train_state.pt (read first), then the .txt
        publish(staged, tracker)
    _fsync(save.save_dir)
    if save.keep and save.keep > 0:
        _keep_most_recent(save)


def _keep_most_recent(save: _Save) -> None:
    """Upstream's most_recent_k, on complete iterations up to the committed one; never anything newer."""
    from bridge_ext.checkpoints import is_complete, iterations

    found = iterations(save.save_dir)
    keep = [n for n, path in found.items() if n <= save.iteration and is_complete(path)][-save.keep:]
    for number, path in found.items():
        if number < save.iteration and number not in keep:
            shutil.rmtree(path, ignore_errors=True)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ resume
def prepare_resume(cfg: Any, *, checksums: bool = True) -> str | None:
    """Decide the iteration this run loads from ``checkpoint.load`` and check it; the lines to say, or None.

    When the tracker names an incomplete iteration, ``checkpoint.ckpt_step`` is set to the newest complete
    one (Megatron Bridge's own way to load a given iteration). A ``UserError`` when there is nothing to resume
    from but a tracker, when ``checkpoint.ckpt_step`` names an incomplete iteration, or when the
    ``checkpoint.pretrained_checkpoint`` a fresh run starts from names one (it has no ``ckpt_step``).

    The iteration loaded is vetted (its pickles) and verified (``bridge_ext.checkpoints.integrity``: sizes, and the
    checksums of what the load reads, split between the ranks; ``checksums=False``: sizes only).
    """
    from bridge_ext.checkpoints import iteration_dir, missing_files, read_tracker, resume_point, vet_checkpoint
    from bridge_ext.errors import UserError

    _saved.clear()
    ckpt = cfg.checkpoint
    lines: list[str] = []

    def verified(iter_dir: Path, scope: str) -> None:
        from bridge_ext.checkpoints.integrity import verify
        from bridge_ext.runtime import launcher_rank, world_size

        result = verify(iter_dir, scope=scope, rank=launcher_rank(), world_size=world_size(),
                        checksums=checksums)
        lines.append(result.line(iter_dir) + (" (this rank's share)" if world_size() > 1 and result.recorded
                                               and checksums else ""))
    if ckpt.pretrained_checkpoint and (not ckpt.load or read_tracker(ckpt.load)[0] is None):
        try:  # loaded (weights only) when checkpoint.load holds nothing yet
            start = resume_point(ckpt.pretrained_checkpoint)
        except UserError as exc:
            raise UserError(f"checkpoint.pretrained_checkpoint: {exc}") from None
        if start.overrides_tracker:
            raise UserError(f"checkpoint.pretrained_checkpoint: {start.note.split('; ')[0]}; Megatron Bridge loads "
                            "only the iteration its tracker names")
        if start.iteration is not None:
            verified(iteration_dir(ckpt.pretrained_checkpoint, start.iteration), "model")  # weights only
    if not ckpt.load:
        return "\n".join(lines) or None
    scope = "all" if getattr(ckpt, "load_optim", True) else "model"
    if ckpt.ckpt_step is not None:
        missing = missing_files(iteration_dir(ckpt.load, ckpt.ckpt_step))
        if missing:
            raise UserError(f"checkpoint.ckpt_step={ckpt.ckpt_step}: iteration {ckpt.ckpt_step} in {ckpt.load} is "
                            f"incomplete (missing {', '.join(missing)})")
        vet_checkpoint(iteration_dir(ckpt.load, ckpt.ckpt_step), ckpt.load)
        verified(iteration_dir(ckpt.load, ckpt.ckpt_step), scope)
        return "\n".join(lines) or None
    point = resume_point(ckpt.load)
    if point.iteration is not None:
        verified(iteration_dir(ckpt.load, point.iteration), scope)
    if point.iteration is not None and ckpt.save and os.path.realpath(ckpt.load) == os.path.realpath(ckpt.save):
        _saved.add((os.path.realpath(ckpt.save), point.iteration))
    if point.overrides_tracker:
        ckpt.ckpt_step = point.iteration
        lines.insert(0, f"resume: {point.note}")
    return "\n".join(lines) or None


# ------------------------------------------------------------------------------------------- SIGTERM stop
def stop_line(cfg: Any) -> str | None:
    """What the run does on its exit signal, for the console at start (None when the handler is off)."""
    if not cfg.train.exit_signal_handler:
        return None
    name = signal.Signals(cfg.train.exit_signal).name
    if not cfg.checkpoint.save:
        return f"on {name}: stops after the current iteration (checkpoint.save is unset: nothing is saved)"
    return f"on {name}: finishes the current iteration, saves a checkpoint to {cfg.checkpoint.save}, exits 0"


# How long a signal held during start-up waits for training to start (issue 50: a start-up that never reaches
# training -- megatron-core's GPTDataset spinning on an empty split -- ignored SIGTERM for as long as it was left).
# Before training there is nothing new to save, so giving up loses nothing; loading a large checkpoint can take
# minutes, hence minutes. BRIDGE_EXT_STARTUP_GRACE_S sets it (seconds).
STARTUP_GRACE_S = 300.0


def startup_grace_s() -> float:
    value = os.environ.get("BRIDGE_EXT_STARTUP_GRACE_S", "")
    try:
        return float(value) if value else STARTUP_GRACE_S
    except ValueError:
        return STARTUP_GRACE_S


@dataclass
class _Hold:
    previous: Any  # the handler before the hold
    received: bool = False
    after_training: bool = False  # training ran and ended: a signal now finds nothing left to stop
    deadline: Any = None  # a threading.Timer: the start-up bound, running from the first signal noted

    def note(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.deadline is None and not self.after_training:
            import threading

            grace = startup_grace_s()
            self.deadline = threading.Timer(grace, _give_up_start_up, args=(signum, grace))
            self.deadline.daemon = True
            self.deadline.start()

    def stop_deadline(self) -> None:
        """Training started, or the hold ends: the start-up bound no longer applies."""
        if self.deadline is not None:
            self.deadline.cancel()

    def release(self, sig: int) -> None:
        """Hand the signal back to the previous handler; one that came meanwhile is delivered to it now."""
        self.stop_deadline()
        signal.signal(sig, self.previous)
        if self.received:
            self.received = False
            signal.raise_signal(sig)


def _give_up_start_up(signum: int, grace: float) -> None:
    """The start-up bound passed with the signal held and training not started: end the process now (from the
    timer's thread: the main thread may be in a loop that never returns), as the signal would have."""
    name = signal.Signals(signum).name
    print(f"{name} came during start-up and training had not started {grace:.0f} s later: the run ends, nothing "
          "saved", file=sys.stderr, flush=True)
    os._exit(128 + signum)


_holds: dict[int, _Hold] = {}


@contextlib.contextmanager
def held_exit_signal(sig: int = signal.SIGTERM):
    """Note ``sig`` instead of dying of it until training starts (see the module docstring); the training run
    (:func:`graceful_stop`) takes it over, or it is released when the block ends."""
    if sig in _holds or not _in_main_thread():
        yield
        return
    hold = _holds[sig] = _Hold(previous=signal.getsignal(sig))
    signal.signal(sig, hold.note)
    try:
        yield
    finally:
        if _holds.pop(sig, None) is hold:
            name = signal.Signals(sig).name
            if hold.received and hold.after_training:  # the run finished (and saved) before it came
                print(f"{name} came after training ended: nothing left to stop", file=sys.stderr,
                      flush=True)
                hold.received = False
            elif hold.received:  # the run ended before training started (an error, or nothing to train)
                print(f"{name} came before training started: the run ends, nothing saved", file=sys.stderr,
                      flush=True)
            hold.release(sig)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def graceful_stop():
    """A Megatron Bridge callback that installs ``state.signal_handler`` when training starts (and removes it
    when the run ends, :meth:`release`: under :func:`held_exit_signal` the signal is then held again until the
    command returns). Repeated signals during the save are absorbed; SIGKILL still stops.

    The signal itself is only noted; upstream's handler (which prints) is called at the end of the training
    step, before Megatron Bridge checks it (``train.py``: ``on_train_step_end`` fires before
    ``checkpoint_and_decide_exit``). Called from the signal, its print met a write of the same stream that the
    signal interrupted (our console routes output through Python): "RuntimeError: reentrant call inside
    BufferedWriter", and the run died instead of saving."""
    from megatron.bridge.training.callbacks import Callback

    class GracefulStop(Callback):
        handler: Any = None
        upstream: Any = None  # upstream's handler, called from on_train_step_end
        sig: int | None = None
        hold: _Hold | None = None  # held_exit_signal's, kept for the end of training
        came = False  # the exit signal arrived (set in the signal handler: nothing else happens there)
        received = False  # upstream was told: the run stops after this step, on purpose

        def on_train_start(self, context: Any) -> None:
            if not context.state.cfg.train.exit_signal_handler:
                for sig in list(_holds):  # nobody stops on a signal: it acts as it did before the hold
                    _holds.pop(sig).release(sig)
                return
            handler = context.state.signal_handler
            hold = self.hold = _holds.get(handler.sig)
            if hold is not None:  # upstream's handler restores the one before the hold when the run ends
                hold.stop_deadline()
                signal.signal(handler.sig, hold.previous)
            current = signal.getsignal(handler.sig)
            if "DistributedSignalHandler" not in getattr(current, "__qualname__", ""):  # not installed yet
                handler.__enter__()
                self.handler = handler
            self.upstream, self.sig = signal.getsignal(handler.sig), handler.sig

            def note(signum: int, frame: Any) -> None:
                self.came = True

            signal.signal(handler.sig, note)
            if hold is not None and hold.received:  # it came while the run was starting: stop after one iteration
                self.came, hold.received = True, False
            for sig in [sig for sig in _holds if sig != handler.sig]:  # another signal held (the config stops on
                _holds.pop(sig).release(sig)  # a different one): released

        def on_train_step_end(self, context: Any) -> None:
            if self.came and not self.received:
                self.received = True
                self.upstream(self.sig, None)

        def release(self) -> None:
            if self.handler is not None:
                self.handler.release()
                self.handler = None
            if self.hold is not None and _holds.get(self.sig) is self.hold:  # held again until the command returns
                self.hold.after_training = True
                signal.signal(self.sig, self.hold.note)

    return GracefulStop()


# ------------------------------------------------------------------------------------------ helper processes
def exit_with_parent(parent_pid: int | None = None) -> None:
    """In a helper process: be killed when the process that started it dies (Linux ``PR_SET_PDEATHSIG``), and
    ignore SIGTERM: Slurm sends it to every process of a job step (a time limit, ``scancel --signal=TERM``), and a
    save helper or data worker that died of it failed the save the trainer then made (the trainer decides; its
    helpers end with it)."""
    import ctypes

    if _in_main_thread():  # the only thread that may set a handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to hold on to
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)  # the parent died before prctl took effect


def _results_server(parent_pid: int) -> None:
    """Initializer of the writer's Manager server: die with the trainer, and import what the write results
    need to be unpickled (torch) now, so the first save does not wait for that import.

    In the initializer, not in a background thread: a thread importing torch while the server's request
    threads unpickled the first write result broke both ways (``_DeadlockError`` on
    ``torch.distributed.checkpoint.storage``, or a half-initialised ``torch`` that aborted the server).
    The trainer's ``manager.start()`` waits for it, once, when the run starts.
    """
    exit_with_parent(parent_pid)  # ignores SIGTERM from here on
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked by the trainer while this started
    importlib.import_module("torch.distributed.checkpoint")


class _AfterFork:
    """Anchor for multiprocessing.util.register_after_fork (it keeps only a weak reference)."""


_after_fork_anchor = _AfterFork()
_managers: list[Any] = []


def keep_helpers_with_trainer(*, start_now: bool = False) -> None:
    """No process outlives its trainer (idempotent; ``start_now``: start the save helpers already).

    megatron-core's torch_dist writer (``dist_checkpointing/strategies/filesystem_async.py``,
    ``_get_write_results_queue``, 0.17+ ``get_write_results_queue``) starts a ``multiprocessing`` Manager
    server with the spawn method at the first save, which in turn starts a resource tracker; a trainer killed
    with SIGKILL left both running forever. The Manager is started here (and by the
    ``checkpoint-writer-dies-with-trainer`` patch) with :func:`exit_with_parent` in its initializer instead, and every
    process forked through ``multiprocessing`` (writer processes, data loader workers) gets the same. Started
    with the run (``start_now``), the Manager has imported torch by the first save: that import, on the first
    write result the server unpickles, made the first save seconds slower, a SIGTERM's save included.
    """
    import multiprocessing
    import multiprocessing.util

    if not getattr(_after_fork_anchor, "registered", False):
        multiprocessing.util.register_after_fork(
            _after_fork_anchor, lambda _: exit_with_parent(getattr(multiprocessing.parent_process(), "pid", None)))
        _after_fork_anchor.registered = True
    writer = importlib.import_module(_WRITER)
    factory = getattr(writer, "_get_write_results_queue", None) or \
        getattr(writer, "get_write_results_queue", None)  # megatron-core 0.17+'s name
    if start_now and factory is not None and "Manager()" in inspect.getsource(inspect.unwrap(factory)):
        start_results_server()


_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def start_results_server() -> None:
    """Start the torch_dist writer's results Manager with :func:`exit_with_parent` in its initializer (once;
    the ``checkpoint-writer-dies-with-trainer`` patch calls it before the writer's own factory would)."""
    import multiprocessing
    import threading
    from multiprocessing.managers import SyncManager

    writer = importlib.import_module(_WRITER)
    # PR_SET_PDEATHSIG fires when the creating *thread* ends: only start it from the main thread
    if writer._results_queue is None and threading.current_thread() is threading.main_thread():
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        # SIGTERM blocked while the server process starts (the mask survives fork and exec): Slurm signals every
        # process of the step, and one that landed before the server's initializer ignores it killed the server,
        # and with it the run (manager.start() failed); here it stays pending until the trainer unblocks it
        # (the resource tracker first: starting it unblocks SIGTERM again, multiprocessing/resource_tracker.py
        # ensure_running, which the server's start would otherwise call after our block)
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            manager.start(initializer=_results_server, initargs=(os.getpid(),))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _managers.append(manager)  # a collected manager shuts its server down
        writer._results_queue = manager.Queue()
