"""``nemo``: this package's ``nemo llm`` commands, one module each, and NeMo-Run's CLI for the rest.

This package installs a ``nemo`` command. NeMo-Run (in the NeMo container) installs one too; what this package
does not handle is handed to NeMo-Run's CLI unchanged when NeMo-Run can serve it (``nemo llm pretrain --factory
...`` with NeMo's ``llm`` group installed, ``nemo experiment ...``); otherwise one line says why, exit 2. The
decision is :data:`COMMANDS`'s: a command of ours without its ``--recipe`` is our one-line error, unless it
carries NeMo-Run's option of that command (``--factory``).

``recipes`` and ``info`` read the shipped configs only: no command module imports torch or Megatron until it
runs. ``python -m bridge_ext.commands`` is the same as ``nemo``.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from bridge_ext.commands import (
    compare,
    evaluate,
    finetune,
    generate,
    hf_export,
    hf_import,
    info,
    muon_plan,
    plan,
    prepare_data,
    pretrain,
    recipes,
    rehearse,
)
from bridge_ext.commands.common import Command, Parser, error
from bridge_ext.errors import UserError
from bridge_ext.stack import UpstreamDrift

__all__ = ["COMMANDS", "NEMO_RUN_GROUPS", "build_parser", "main", "nemo_run_commands"]

# The `nemo llm` commands, in `nemo llm --help` order.
COMMANDS: tuple[Command, ...] = (
    Command("recipes", recipes.add_parser, recipes.run),
    Command("info", info.add_parser, info.run),
    Command("pretrain", pretrain.add_parser, pretrain.run, recipe="needed", nemo_run="--factory"),
    Command("import", hf_import.add_parser, hf_import.run),
    Command("export", hf_export.add_parser, hf_export.run),
    Command("prepare-data", prepare_data.add_parser, prepare_data.run),
    Command("compare", compare.add_parser, compare.run),
    Command("muon-plan", muon_plan.add_parser, muon_plan.run),
    Command("plan", plan.add_parser, plan.run),
    Command("rehearse", rehearse.add_parser, rehearse.run),
    Command("finetune", finetune.add_parser, finetune.run, recipe="needed", nemo_run="--factory", unless=("--list",)),
    Command("evaluate", evaluate.add_parser, evaluate.run),
    Command("generate", generate.add_parser, generate.run),
)
_BY_NAME = {command.name: command for command in COMMANDS}
_HELP = ("-h", "--help")

# NeMo-Run's own top-level command groups besides its `nemo_run.cli` entry points (nemo_run/cli/api.py
# create_cli adds "devspace" and "experiment"; NeMo registers "llm" as an entry point).
NEMO_RUN_GROUPS = ("devspace", "experiment")


def build_parser() -> Parser:
    root = Parser(prog="nemo", description="Megatron Bridge recipes for Kimi K2 and Qwen3 with Muon.")
    groups = root.add_subparsers(dest="group", required=True, parser_class=Parser)
    llm = groups.add_parser("llm", help="LLM recipes")
    sub = llm.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub, command.name).set_defaults(func=command.run)
    return root


def nemo_run_commands() -> frozenset[str] | None:
    """NeMo-Run's top-level commands, read from package metadata (NeMo-Run is not imported); None when NeMo-Run
    is not installed."""
    from importlib import metadata

    try:
        metadata.distribution("nemo_run")
    except metadata.PackageNotFoundError:
        return None
    return frozenset({*NEMO_RUN_GROUPS, *metadata.entry_points(group="nemo_run.cli").names})


def _given(argv: list[str], option: str) -> bool:
    return any(a == option or a.startswith(f"{option}=") for a in argv)


def _route(argv: list[str]) -> Literal["ours", "nemo_run"]:
    """Ours or NeMo-Run's; a ``UserError`` when neither can run ``argv``."""
    if not argv or argv[0] in _HELP or argv == ["llm"]:
        return "ours"
    if argv[0] != "llm":
        return _nemo_run_serves(argv, f"`nemo {argv[0]}` is not a command of this package (`nemo llm --help`)")
    command = _BY_NAME.get(argv[1])
    if command is None:
        if argv[1] in _HELP:
            return "ours"
        return _nemo_run_serves(argv, f"`nemo llm {argv[1]}` is not a command of this package (`nemo llm --help`)")
    rest = argv[2:]
    if command.recipe != "needed" or _given(rest, "--recipe") or any(_given(rest, o) for o in command.unless) \
            or any(a in _HELP for a in rest):
        return "ours"
    needs = f"nemo llm {command.name} needs --recipe NAME (see nemo llm recipes)"
    if command.nemo_run and _given(rest, command.nemo_run):  # NeMo's own recipes, by factory
        return _nemo_run_serves(argv, f"{needs}; `nemo llm {command.name} {command.nemo_run}` is NeMo-Run's")
    raise UserError(needs)


def _nemo_run_serves(argv: list[str], ours: str) -> Literal["nemo_run"]:
    commands = nemo_run_commands()
    if commands is None:
        raise UserError(f"{ours}, and NeMo-Run, which serves the other `nemo` commands, is not installed")
    if argv[0] not in commands and not argv[0].startswith("-"):
        raise UserError(f"{ours}; the installed NeMo-Run has no `{argv[0]}` commands either (it has: "
                        f"{', '.join(sorted(commands))})")
    return "nemo_run"


def _nemo_run(argv: list[str]) -> int:
    """NeMo-Run's ``nemo`` (e.g. ``nemo llm pretrain --factory ...``), argv unchanged."""
    from nemo_run.__main__ import app

    return app(args=argv, prog_name="nemo")


def main(argv: list[str] | None = None) -> int:
    """The ``nemo`` command; returns its exit code (bad input: one ``error:`` line on stderr, 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if _route(argv) == "nemo_run":
            return _nemo_run(argv)
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UserError, UpstreamDrift) as exc:  # bad input, or installed code that a fix does not know
        error(str(exc))
        return 2
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except BrokenPipeError:  # e.g. `nemo llm pretrain ... --dryrun | head`
        sys.stdout = open(os.devnull, "w")
        return 0
