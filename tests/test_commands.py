"""The ``nemo`` command table (``bridge_ext.commands``): every command has a parser, NeMo-Run's share is decided
there, a missing ``--recipe`` is our one line, and the fast commands load neither torch nor Megatron."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge_ext import commands

pytestmark = pytest.mark.once  # the CLI's wiring: the same on every stack

ROOT = Path(__file__).resolve().parent.parent
# Every `nemo llm` command, as docs/cli.md lists them.
EXPECTED = ("recipes", "info", "pretrain", "import", "export", "prepare-data", "compare", "muon-plan", "plan",
            "rehearse", "finetune", "evaluate", "generate")


def _llm_subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (root,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (llm,) = [a for a in root.choices["llm"]._actions if isinstance(a, argparse._SubParsersAction)]
    return llm.choices


def test_the_table_lists_every_command_with_its_own_parser_and_runner():
    assert [c.name for c in commands.COMMANDS] == list(EXPECTED)
    parsers = _llm_subparsers(commands.build_parser())
    assert list(parsers) == list(EXPECTED)
    for command in commands.COMMANDS:
        parser = parsers[command.name]
        assert parser.prog == f"nemo llm {command.name}" and parser.get_default("func") is command.run
        # the runner lives in the command's own module, one module per command
        assert command.run.__module__.startswith("bridge_ext.commands.") and command.run.__name__ == "run"
    assert len({c.run.__module__ for c in commands.COMMANDS}) == len(EXPECTED)


def test_the_table_module_loads_its_commands_by_import_statements_only():
    """No importlib: the import graph sees every command module (tests/test_layering.py checks the package)."""
    tree = ast.parse((ROOT / "bridge_ext" / "commands" / "__init__.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "bridge_ext.commands" for alias in node.names}
    assert {c.run.__module__.rsplit(".", 1)[1] for c in commands.COMMANDS} <= imported
    assert "importlib" not in {alias.name.split(".")[0] for node in ast.walk(tree)
                               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


@pytest.mark.parametrize(("argv", "line"), [
    (["llm", "pretrain", "--dryrun"], "error: nemo llm pretrain needs --recipe NAME (see nemo llm recipes)\n"),
    (["llm", "pretrain", "layout=cpu", "train.train_iters=3"],
     "error: nemo llm pretrain needs --recipe NAME (see nemo llm recipes)\n"),
    (["llm", "finetune"], "error: nemo llm finetune needs --recipe NAME (see nemo llm recipes)\n"),
    (["llm", "finetune", "--data", "x.jsonl", "--dryrun"],
     "error: nemo llm finetune needs --recipe NAME (see nemo llm recipes)\n"),
])
def test_a_missing_recipe_is_our_one_line_without_nemo_run(capsys, monkeypatch, argv, line):
    """Before: `nemo llm pretrain --dryrun` went to NeMo-Run's CLI (a pynvml warning, "No such command 'llm'")."""
    monkeypatch.delitem(sys.modules, "nemo_run", raising=False)
    monkeypatch.delitem(sys.modules, "nemo_run.__main__", raising=False)
    assert commands.main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line)
    assert "nemo_run" not in sys.modules and "nemo_run.__main__" not in sys.modules


@pytest.mark.parametrize(("argv", "installed", "message"), [
    (["llm", "pretrain", "--factory", "llama3_8b"], None,
     "error: nemo llm pretrain needs --recipe NAME (see nemo llm recipes); `nemo llm pretrain --factory` is "
     "NeMo-Run's, and NeMo-Run, which serves the other `nemo` commands, is not installed\n"),
    (["llm", "finetune", "--factory", "llama3_8b"], frozenset({"devspace", "experiment"}),
     "error: nemo llm finetune needs --recipe NAME (see nemo llm recipes); `nemo llm finetune --factory` is "
     "NeMo-Run's; the installed NeMo-Run has no `llm` commands either (it has: devspace, experiment)\n"),
    (["foo"], frozenset({"devspace", "experiment"}),
     "error: `nemo foo` is not a command of this package (`nemo llm --help`); the installed NeMo-Run has no `foo` "
     "commands either (it has: devspace, experiment)\n"),
    (["experiment", "list"], None,
     "error: `nemo experiment` is not a command of this package (`nemo llm --help`), and NeMo-Run, which serves the "
     "other `nemo` commands, is not installed\n"),
    (["llm", "validate"], frozenset({"devspace", "experiment"}),
     "error: `nemo llm validate` is not a command of this package (`nemo llm --help`); the installed NeMo-Run has "
     "no `llm` commands either (it has: devspace, experiment)\n"),
])
def test_a_passthrough_nemo_run_cannot_serve_says_so_in_one_line(capsys, monkeypatch, argv, installed, message):
    monkeypatch.setattr(commands, "nemo_run_commands", lambda: installed)
    monkeypatch.setattr(commands, "_nemo_run", lambda argv: pytest.fail(f"NeMo-Run was called for {argv}"))
    assert commands.main(argv) == 2
    assert capsys.readouterr() == ("", message)


def test_nemo_run_gets_what_it_serves_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(commands, "nemo_run_commands", lambda: frozenset({"devspace", "experiment", "llm"}))
    monkeypatch.setattr(commands, "_nemo_run", lambda argv: calls.append(argv) or 0)
    for argv in (["llm", "pretrain", "--factory", "llama3_8b", "trainer.max_steps=5"], ["experiment", "list"],
                 ["llm", "finetune", "--factory=llama3_8b"], ["llm", "validate", "--factory", "x"]):
        assert commands.main(argv) == 0
    assert calls == [["llm", "pretrain", "--factory", "llama3_8b", "trainer.max_steps=5"], ["experiment", "list"],
                     ["llm", "finetune", "--factory=llama3_8b"], ["llm", "validate", "--factory", "x"]]
    # ours, whatever NeMo-Run has: a --recipe (with a stray --factory: argparse refuses it), --list, --help
    for argv in (["llm", "finetune", "--list"], ["llm", "pretrain", "--recipe", "x", "--factory", "y"]):
        assert commands._route(argv) == "ours"


def test_nemo_run_commands_come_from_its_metadata_without_importing_it():
    code = ("import sys; from bridge_ext.commands import nemo_run_commands; found = nemo_run_commands(); "
            "print(sorted(found) if found is not None else None, 'nemo_run' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    found, imported = run.stdout.rsplit(" ", 1)
    assert imported.strip() == "False"
    from importlib import metadata

    try:
        metadata.distribution("nemo_run")
    except metadata.PackageNotFoundError:
        assert found == "None"
    else:  # NeMo-Run 0.8.0 (both stacks): its own groups and whatever registers `nemo_run.cli` entry points
        names = {ep.name for ep in metadata.entry_points(group="nemo_run.cli")}
        assert json.loads(found.replace("'", '"')) == sorted({"devspace", "experiment", *names})


def test_recipes_and_info_import_neither_torch_nor_megatron_in_a_fresh_interpreter():
    code = (
        "import sys\n"
        "from bridge_ext.commands import main\n"
        "assert main(['llm', 'recipes', '--json']) == 0\n"
        "assert main(['llm', 'info', '--recipe', 'kimi_k2_muon']) == 0\n"
        "assert main(['llm', 'info', '--recipe', 'qwen3_proxy_sft_muon', '--json']) == 0\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers', 'nemo_run'})\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "HEAVY []"


def test_python_m_bridge_ext_commands_is_nemo():
    run = subprocess.run([sys.executable, "-m", "bridge_ext.commands", "llm", "pretrain", "--dryrun"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (
        2, "", "error: nemo llm pretrain needs --recipe NAME (see nemo llm recipes)\n")
    run = subprocess.run([sys.executable, "-m", "bridge_ext.commands", "llm", "recipes"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("recipe ")
