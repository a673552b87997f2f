"""Test driver for tests/test_kill_safe.py: runs ``nemo llm ...`` commands in forked children of one process that
has already imported the stack (a fresh interpreter per command would spend most of the test importing), and
signals a child at a chosen moment of a checkpoint save, the way a scheduler or a node failure would.

Test code only: the moments are found with a Python audit hook (files opened for writing, renames), and the
start of an iteration with a wrapper around Megatron Bridge's ``train_step``, installed in the child.

stdin, one JSON object per line::

    {"argv": ["llm", "pretrain", ...], "cwd": DIR, "log": FILE,
     "events": [{"before": "run_config.yaml", "iteration": 4, "signal": "KILL"},   # a file of iter_0000004
                {"step": 5, "signal": "TERM"}]}                                    # when iteration 5 starts

stdout, one JSON object per line: ``{"status": exit code or -signal, "fired": [...], "survivors": [...],
"seconds": s, "reaped_after": s}``; ``survivors``: processes of the child's session still alive 20 s after it
ended (zombies are dead and do not count); ``reaped_after``: how long after it ended the last one was alive.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _names(path: str) -> set[str]:
    """The file a write is for: ``X``, or the ``.X.tmp`` / ``X.tmp`` that atomic writers rename into ``X``."""
    name = os.path.basename(path)
    names = {name}
    if name.endswith(".tmp"):
        names |= {name[:-4], name[1:-4] if name.startswith(".") else name[:-4]}
    return names


def _install(events: list[dict]) -> None:
    trainer = os.getpid()
    pending = list(events)

    def fire(event: dict) -> None:
        pending.remove(event)
        os.write(2, f"FIRED {json.dumps(event)}\n".encode())  # the log tells the parent what happened
        os.kill(trainer, getattr(signal, f"SIG{event['signal']}"))

    def audit(name: str, args: tuple) -> None:
        if name == "open" and args[1] and any(c in str(args[1]) for c in "wax+"):
            path = str(args[0])
        elif name == "os.rename":
            path = str(args[1])  # os.replace raises it too: the destination is what is written
        else:
            return
        for event in [e for e in pending if "before" in e]:
            iter_dir = f"iter_{event['iteration']:07d}"
            if event["before"] in _names(path) and iter_dir in str(args[0]):
                fire(event)

    sys.addaudithook(audit)
    from megatron.bridge.training import train

    original = train.train_step

    def train_step(*args, **kwargs):
        state = next(a for a in (*args, *kwargs.values()) if hasattr(a, "train_state"))
        for event in [e for e in pending if e.get("step") == state.train_state.step + 1]:
            fire(event)  # mid-iteration: the handler runs now, the iteration still completes
        return original(*args, **kwargs)

    train.train_step = train_step


def _child(request: dict) -> None:
    os.setsid()  # its helper processes stay in this session, so the parent can look for survivors
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(request.get("cwd") or ".")
    _install(request.get("events", []))
    from bridge_ext.commands import main

    try:
        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()  # multiprocessing's finalizers (a forked child skips them with os._exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _session(sid: int) -> list[str]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    dead = f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, waiting for init to reap it
                if os.getsid(int(entry)) == sid and not dead:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        alive.append(f"{entry}: {f.read().replace(b'\0', b' ').decode(errors='replace')[:200]}")
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return alive


def main() -> None:
    # Import what every command needs once; the children start from here.
    import bridge_ext.commands  # noqa: F401
    import bridge_ext.training  # noqa: F401
    import megatron.bridge.training.gpt_step  # noqa: F401
    import megatron.bridge.training.pretrain  # noqa: F401
    from bridge_ext.build import quiet_megatron

    quiet_megatron()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.monotonic()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        ran = time.monotonic() - start
        deadline = time.monotonic() + 20
        while (survivors := _session(pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        with open(request["log"]) as f:
            fired = [json.loads(line.split("FIRED ", 1)[1]) for line in f if line.startswith("FIRED ")]
        print(json.dumps({"status": code, "fired": fired, "survivors": survivors, "seconds": round(ran, 2),
                          "reaped_after": round(time.monotonic() - start - ran, 2)}), flush=True)


if __name__ == "__main__":
    main()
