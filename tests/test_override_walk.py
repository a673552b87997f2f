"""The walk of one override (docs/architecture.md, "The walk of one override"), measured on a real command.

``nemo llm pretrain --recipe qwen3_8b_muon optimizer.lr=V`` runs in-process with Megatron Bridge's
``pretrain()`` replaced (its call needs GPUs, as in tests/test_cli.py); a trace function (``sys.settrace``)
sees every Python call while the command runs, and the value's path is read from it:

- *hand-offs*: each call from our code into Megatron Bridge / megatron-core whose arguments hold the value
  (the override text, the parsed value, a config holding ``optimizer.lr == V``). Our files on the stack at
  each hand-off, outermost first, are one chain of the walk (``bridge_ext/patches/`` frames count as the
  upstream code they change); no chain may enter a file twice, and together they are the documented walk,
  each file once;
- *entries*: calls from one of our files into another whose arguments hold the value. The walk's files are
  entered once each (a file entered again would be a step that went back: the issue's ``build.py`` six
  times);
- the pipeline's steps run once: the template, the preset, the overrides, the derived values.

The command runs once untraced first (imports, Megatron Bridge's model classes), so the trace costs seconds.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = tuple(f"{REPO / package}/" for package in ("bridge_ext", "recipes"))
VALUE = 3.21e-4  # no preset's learning rate: only the override carries it
OVERRIDE = f"optimizer.lr={VALUE}"
PATCHES = "bridge_ext/patches/"  # changes to upstream code: their frames count as upstream's
GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

# docs/architecture.md: the files of the walk, in order.
WALK = ["bridge_ext/commands/__init__.py", "bridge_ext/commands/pretrain.py", "bridge_ext/commands/common.py",
        "bridge_ext/build.py", "bridge_ext/overrides.py", "bridge_ext/training.py"]


def carries(obj, depth: int = 0) -> bool:
    """Whether ``obj`` holds the override: its text, the value, or a config / optimizer config set to it."""
    if depth > 3:
        return False
    if isinstance(obj, str):
        return obj == OVERRIDE
    if isinstance(obj, float):
        return obj == VALUE
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(carries(item, depth + 1) for item in obj)
    if isinstance(obj, dict):
        return any(carries(item, depth + 1) for item in obj.values())
    if isinstance(obj, argparse.Namespace):
        return carries(list(vars(obj).values()), depth + 1)
    name = type(obj).__name__  # Megatron Bridge's dataclasses, by name: no attribute reads on arbitrary objects
    if name == "ConfigContainer":
        return getattr(obj.__dict__.get("optimizer"), "lr", None) == VALUE
    if name == "OptimizerConfig":
        return obj.__dict__.get("lr") == VALUE
    return False


def ours(filename: str) -> str | None:
    return filename[len(str(REPO)) + 1:] if filename.startswith(OURS) else None


class Trace:
    """Hand-off chains, cross-file entries and per-function call counts of one traced run."""

    def __init__(self, *, megatron_stand_ins: tuple = ()):
        self._stand_ins = {function.__code__ for function in megatron_stand_ins}
        self.chains: list[list[str]] = []
        self.entries: list[tuple[str, str]] = []  # (file, function) entered from another of our files
        self.calls: Counter[tuple[str, str]] = Counter()
        self._generators: list = []  # started generator frames (a resumption is a "call" event too)

    def __call__(self, frame, event, arg):
        if event != "call":
            return None
        code = frame.f_code
        if code.co_flags & GENERATOR:
            if any(f is frame for f in self._generators):
                return None
            self._generators.append(frame)
        callee, caller = ours(code.co_filename), frame.f_back and ours(frame.f_back.f_code.co_filename)
        if callee is not None:
            self.calls[callee, code.co_name] += 1
        if caller is None or callee == caller:
            return None
        n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
        if not any(carries(frame.f_locals.get(name)) for name in code.co_varnames[:n]):
            return None
        if callee is not None:
            self.entries.append((callee, code.co_name))
        elif "/megatron/" in code.co_filename or code in self._stand_ins:
            self.chains.append(self._chain(frame.f_back))
        return None

    @staticmethod
    def _chain(frame) -> list[str]:
        files = []
        while frame is not None:
            name = ours(frame.f_code.co_filename)
            if name is not None and not name.startswith(PATCHES) and (not files or files[-1] != name):
                files.append(name)
            frame = frame.f_back
        return files[::-1]


@pytest.mark.slow
def test_the_walk_of_optimizer_lr_visits_each_file_once(capsys, monkeypatch):
    import torch

    from bridge_ext import commands, patches

    patches.apply("import")
    from megatron.bridge.training import pretrain as mb_pretrain

    from bridge_ext.muon import install_ns_coefficients

    handed: list = []

    def pretrain(cfg, step, callbacks):
        handed.append(cfg)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mb_pretrain, "pretrain", pretrain)
    argv = ["llm", "pretrain", "--recipe", "qwen3_8b_muon", OVERRIDE]
    trace = Trace(megatron_stand_ins=(pretrain,))
    previous = sys.gettrace()
    try:
        assert commands.main(argv) == 0, capsys.readouterr().err  # warm: what is imported once is imported
        sys.settrace(trace)
        try:
            code = commands.main(argv)
        finally:
            sys.settrace(previous)
    finally:
        install_ns_coefficients("quintic")  # process-wide; leave megatron-core's default for other tests
    assert code == 0, capsys.readouterr().err
    assert len(handed) == 2 and handed[-1].optimizer.lr == VALUE

    # Hand-offs: the override to Megatron Bridge's parser and apply_overrides (overrides.py), the config to
    # its validation (build.py) and to pretrain() (training.py).
    assert trace.chains
    for chain in trace.chains:
        assert len(chain) == len(set(chain)), chain
        assert [WALK.index(name) for name in chain] == sorted(WALK.index(name) for name in chain), chain
    merged = list(dict.fromkeys(name for chain in trace.chains for name in chain))
    assert merged == WALK
    assert trace.chains[-1] == ["bridge_ext/commands/__init__.py", "bridge_ext/commands/pretrain.py",
                                "bridge_ext/training.py"]  # the last: pretrain() called from training.py

    entered = Counter(name for name, _ in trace.entries if name in WALK)
    assert entered == dict.fromkeys(WALK[1:], 1), trace.entries  # each file once (commands/__init__ starts it)

    steps = {("bridge_ext/build.py", "template"), ("bridge_ext/build.py", "resolve_for_run"),
             ("bridge_ext/muon/presets.py", "apply_preset"), ("bridge_ext/overrides.py", "apply_user_overrides"),
             ("bridge_ext/training.py", "train")}
    assert {step: trace.calls[step] for step in steps} == dict.fromkeys(steps, 1)


def test_the_trace_sees_a_step_that_goes_back(tmp_path, monkeypatch):
    """A planted walk that goes back into a file it left (a -> b -> a) shows as a repeated file in a hand-off
    chain and as a second entry (so the walk test above is not blind to the regression it guards against)."""
    package = tmp_path / "walk_plant"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from walk_plant import b\n"
                                  "def main(args):\n    return b.step(args)\n"
                                  "def back(args, upstream):\n    return upstream(args)\n")
    (package / "b.py").write_text("def step(args):\n    from walk_plant import a\n"
                                  "    return a.back(args, UPSTREAM)\nUPSTREAM = None\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "OURS", (f"{package}/",))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        from walk_plant import a, b

        def upstream(args):  # stands in for Megatron Bridge
            return args

        b.UPSTREAM = upstream
        trace = Trace(megatron_stand_ins=(upstream,))
        previous = sys.gettrace()
        sys.settrace(trace)
        try:
            a.main([OVERRIDE])
        finally:
            sys.settrace(previous)
    finally:
        for name in ("walk_plant", "walk_plant.a", "walk_plant.b"):
            sys.modules.pop(name, None)
    assert trace.chains == [["walk_plant/a.py", "walk_plant/b.py", "walk_plant/a.py"]]
    assert trace.entries == [("walk_plant/b.py", "step"), ("walk_plant/a.py", "back")]
