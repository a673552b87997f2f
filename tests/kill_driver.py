"""Test driver for tests/test_kill_safe.py: ``nemo ARGV`` in this (real) process, which signals itself at a
chosen moment of a checkpoint save, the way a scheduler or a node failure would::

    python tests/kill_driver.py EVENTS_JSON llm pretrain ...

    EVENTS_JSON: [{"before": "run_config.yaml", "iteration": 4, "signal": "KILL"},   # a file of iter_0000004
                  {"before": "tokenizer/", "iteration": 4, "signal": "KILL"},        # its first file in tokenizer/
                  {"step": 5, "signal": "TERM"},                                    # when iteration 5 starts
                  {"hang": "before training"}]                                      # pretrain() never trains

Test code only: the moments are found with a Python audit hook (files opened for writing, renames) and a
wrapper around ``torch.save`` (which opens a path in C++), and the start of an iteration with a wrapper around
Megatron Bridge's ``train_step``. Each event fired is one
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

    def writing(path: str, source: str) -> None:
        for event in [e for e in pending if "before" in e]:
            iter_dir, before = f"iter_{event['iteration']:07d}", event["before"]
            # "DIR/": the first file written into that folder of the iteration
            hit = f"{os.sep}{before}" in path if before.endswith("/") else before in _names(path)
            if hit and iter_dir in source:
                fire(event)

    def audit(name: str, args: tuple) -> None:
        if name == "open" and args[1] and any(c in str(args[1]) for c in "wax+"):
            writing(str(args[0]), str(args[0]))
        elif name == "os.rename":
            writing(str(args[1]), str(args[0]))  # os.replace raises it too: the destination is what is written

    sys.addaudithook(audit)
    import torch

    save = torch.save

    def torch_save(obj, f, *args, **kwargs):  # a path: torch opens the file in C++, which raises no audit event
        if isinstance(f, (str, os.PathLike)):
            writing(os.fspath(f), os.fspath(f))
        return save(obj, f, *args, **kwargs)

    torch.save = torch_save
    from megatron.bridge.training import train

    original = train.train_step

    def train_step(*args, **kwargs):
        state = next(a for a in (*args, *kwargs.values()) if hasattr(a, "train_state"))
        for event in [e for e in pending if e.get("step") == state.train_state.step + 1]:
            fire(event)  # mid-iteration: the handler runs now, the iteration still completes
        return original(*args, **kwargs)

    train.train_step = train_step
    if any("hang" in e for e in pending):  # start-up never trains (megatron-core's GPTDataset on an empty split)
        import time

        from megatron.bridge.training import pretrain as module

        def pretrain(*args, **kwargs):
            os.write(2, b"HANGING before training\n")
            while True:  # Python code: signals are handled, as in that loop
                time.sleep(0.05)

        module.pretrain = pretrain


def main(events: str, argv: list[str]) -> int:
    import bridge_ext  # noqa: F401  (its import-time patches come before Megatron Bridge's modules are imported)

    _install(json.loads(events))
    from bridge_ext.commands import main as nemo

    return nemo(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
