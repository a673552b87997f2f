"""``nemo llm evaluate``: the held-out loss Megatron Bridge's own evaluation gives a saved checkpoint equals what
the training loop's validation printed at that iteration on the same data; ``--all`` and several ``--ckpt`` (a Muon
run and its AdamW twin) in one table, one CSV and one PNG; bad input in one line.

One Muon run and its AdamW twin train 2 iterations once per module (the `nemo` command in this process), saving and
validating at iterations 1 and 2.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from tests.nemo_cli import call_nemo

TRAIN = ["train.train_iters=2", "checkpoint.save_interval=1", "train.eval_interval=1", "train.eval_iters=1",
         "logger.log_interval=1"]


def _train(root: Path, recipe: str) -> Path:
    ckpt = root / recipe
    result = call_nemo(["llm", "pretrain", "--recipe", recipe, f"checkpoint.save={ckpt}", *TRAIN], capture=None,
                       cwd=root)
    assert result.code == 0
    return ckpt


class _Runs(dict):
    """The trained runs, each trained when a test first asks for it (the stack tests need the Muon run only)."""

    def __init__(self, root: Path):
        super().__init__(root=root)

    def __missing__(self, key: str) -> Path:
        self[key] = _train(self["root"], {"muon": "qwen3_proxy_muon", "adamw": "qwen3_proxy_adamw"}[key])
        return self[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory.mktemp("evaluate"))


def printed_validation(ckpt: Path) -> dict[int, list[tuple[str, str]]]:
    """What the training loop printed: iteration -> [(loss, PPL)] as Megatron Bridge formats them (upstream.log
    keeps the run's full output)."""
    found: dict[int, list[tuple[str, str]]] = {}
    pattern = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|")
    for match in pattern.finditer((ckpt / "upstream.log").read_text()):
        found.setdefault(int(match[1]), []).append((match[2], match[3]))
    return found


@pytest.mark.stack
@pytest.mark.slow
def test_equals_the_training_loops_validation_at_that_iteration(nemo, runs):
    printed = printed_validation(runs["muon"])
    assert sorted(printed) == [1, 2]
    result = nemo(["llm", "evaluate", "--ckpt", runs["muon"], "--iteration", "1", "--json"])
    assert result.code == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["iteration"] == 1 and row["eval_tokens"] == 8 * 128 and row["train_tokens"] == 8 * 128
    # iteration 1's pass was the run's first: the validation split from its start, as evaluate reads it
    loss, ppl = printed[1][0]
    assert f"{row['loss']:.6E}" == loss and f"{math.exp(row['loss']):.6E}" == ppl
    assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    assert "[Gloo]" not in result.stdout + result.stderr and "Traceback" not in result.stderr


@pytest.mark.once  # the table, CSV and plot are ours; the number per iteration is checked on every stack above
@pytest.mark.slow
def test_all_iterations_of_a_muon_run_and_its_adamw_twin_in_one_table_csv_and_png(nemo, runs, tmp_path):
    out = tmp_path / "ab"
    result = nemo(["llm", "evaluate", "--ckpt", runs["muon"], "--ckpt", runs["adamw"], "--all", "--out", out])
    assert result.code == 0, result.stderr[-3000:]
    with (out / "evaluate.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(Path(r["run"]).name, int(r["iteration"])) for r in rows] == [
        ("qwen3_proxy_muon", 1), ("qwen3_proxy_muon", 2), ("qwen3_proxy_adamw", 1), ("qwen3_proxy_adamw", 2)]
    assert [int(r["train_tokens"]) for r in rows] == [1024, 2048, 1024, 2048]
    by = {(Path(r["run"]).name, int(r["iteration"])): float(r["loss"]) for r in rows}
    for run in ("muon", "adamw"):  # the first validation pass of each run, as the loop printed it
        assert f"{by[(runs[run].name, 1)]:.6E}" == printed_validation(runs[run])[1][0][0]
    assert (out / "evaluate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = result.stdout.splitlines()
    assert table[1].split()[:6] == ["run", "iteration", "train", "tokens", "eval", "tokens"]
    assert len(table) == 2 + 4


@pytest.mark.stack
@pytest.mark.slow
def test_refuses_an_unknown_iteration_and_missing_data(nemo, runs, tmp_path):
    result = nemo(["llm", "evaluate", "--ckpt", runs["muon"], "--iteration", "3"])
    assert result.code == 2 and "--iteration 3 not found" in result.stderr and "available: 1, 2" in result.stderr
    result = nemo(["llm", "evaluate", "--ckpt", runs["muon"], "--data", tmp_path / "nothing"])
    assert result.code == 2 and "no " in result.stderr and "Traceback" not in result.stderr


@pytest.mark.once
def test_refuses_bad_input_before_loading_anything(nemo, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = [
        (["--ckpt", tmp_path / "nothing"], "does not exist"),
        (["--ckpt", tmp_path / "empty"], "not a Megatron checkpoint"),
        (["--ckpt", tmp_path / "empty", "--all"], "not a Megatron checkpoint"),
        (["--ckpt", tmp_path / "empty", "--tokens", "0"], "--tokens"),
        (["--ckpt", tmp_path, "--iteration", "2", "--all"], "not allowed with argument"),
    ]
    for argv, expected in cases:
        result = nemo(["llm", "evaluate", *argv])
        assert result.code == 2, (argv, result.stderr)
        assert expected in result.stderr, (argv, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
