"""Test driver for tests/test_kill_safe.py: ``nemo ARGV`` in this (real) process, which signals itself at a
chosen moment of a checkpoint save, the way a scheduler or a node failure would::

    python tests/kill_driver.py EVENTS_JSON llm pretrain ...

    EVENTS_JSON: [{"before": "run_config.yaml", "iteration": 4, "signal": "KILL"},   # a file of iter_0000004
                  {"step": 5, "signal": "TERM"}]                                    # when iteration 5 starts

Test code only: the moments are found with a Python audit hook (files opened for writing, renames), and the
start of an iteration with a wrapper around Megatron Bridge's ``train_step``. Each event fired is one
``FIRED {json}`` line on stderr. The process then ends as ``nemo`` would: with the command's exit code, or
killed by the signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys


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
        os.write(2, f"FIRED {json.dumps(event)}\n".encode())  # unbuffered: the log has it before the signal lands
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


def main(events: str, argv: list[str]) -> int:
    import bridge_ext  # noqa: F401  (its import-time patches come before Megatron Bridge's modules are imported)

    _install(json.loads(events))
    from bridge_ext.commands import main as nemo

    return nemo(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
