"""``nemo llm compare``: metrics, outputs, bad input, and a real two-recipe run through pretrain() on CPU."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest

from bridge_ext import commands, compare, data
from bridge_ext.compare import RunResult, iterations_to_reach, smooth, summarize
from bridge_ext.errors import UserError


def nemo_llm(argv: list[str]) -> int:
    """``nemo llm ...`` through the real CLI (one ``error:`` line and exit 2 on bad input)."""
    from bridge_ext import commands

    return commands.main(["llm", *argv])


# ------------------------------------------------------------------------------------------------- metrics
def test_smooth_is_a_trailing_mean():
    assert smooth([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert smooth([1.0, 2.0, 3.0], 10) == [1.0, 1.5, 2.0]


def test_iterations_to_reach_is_one_based():
    assert iterations_to_reach([5.0, 4.0, 3.0, 2.0], 3.0) == 3
    assert iterations_to_reach([5.0, 4.0], 3.0) is None


def test_summary_uses_the_best_loss_of_the_slowest_run():
    fast = [10.0 - i for i in range(10)]  # reaches 1.0
    slow = [10.0 - 0.5 * i for i in range(10)]  # reaches 5.5
    summary = summarize({"fast": fast, "slow": slow}, window=1)
    assert summary["slowest"] == "slow" and summary["target"] == 5.5
    assert summary["runs"]["slow"]["iterations_to_target"] == 10
    assert summary["runs"]["fast"]["iterations_to_target"] == 6  # 10 - 5 = 5.0 <= 5.5 at the 6th iteration
    assert summary["runs"]["fast"]["final_loss"] == 1.0
    text = compare.format_summary(summary)
    assert "fast reached the best loss of slow (5.500, mean of 1) in 6 iterations instead of 10 (1.67x fewer)" in text


def test_csv_and_plot_are_written(tmp_path):
    results = [RunResult("a", [3.0, 2.0, 1.5], 1.0, 2.0), RunResult("b[lr=1e-3]", [3.0, 2.5, 2.0], 1.0, 2.0)]
    compare.write_csv(tmp_path / "loss.csv", results)
    rows = list(csv.reader((tmp_path / "loss.csv").open()))
    assert rows == [["iteration", "a", "b[lr=1e-3]"], ["1", "3.000000", "3.000000"], ["2", "2.000000", "2.500000"],
                    ["3", "1.500000", "2.000000"]]
    summary = summarize({r.label: r.losses for r in results}, window=2)
    compare.write_plot(tmp_path / "loss.png", results, summary, "test")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweeps_are_zipped_into_labelled_runs():
    runs = compare.parse_runs("qwen3_proxy_muon,qwen3_proxy_adamw",
                               ["optimizer.lr=1e-3,3e-3", "optimizer.min_lr=1e-4,3e-4"])
    assert [r.label for r in runs] == [
        "qwen3_proxy_muon[lr=1e-3,min_lr=1e-4]", "qwen3_proxy_muon[lr=3e-3,min_lr=3e-4]",
        "qwen3_proxy_adamw[lr=1e-3,min_lr=1e-4]", "qwen3_proxy_adamw[lr=3e-3,min_lr=3e-4]",
    ]
    assert runs[1].overrides == ["optimizer.lr=3e-3", "optimizer.min_lr=3e-4"]
    assert runs[1].dirname == "qwen3_proxy_muon_lr=3e-3_min_lr=3e-4"
    assert [r.label for r in compare.parse_runs("qwen3_proxy_muon", ["optimizer.lr=1e-3,3e-3"])] == [
        "qwen3_proxy_muon[lr=1e-3]", "qwen3_proxy_muon[lr=3e-3]"]


def test_a_recipe_can_carry_its_own_overrides():
    runs = compare.parse_runs("qwen3_proxy_muon:optimizer.lr=1e-2:optimizer.min_lr=1e-3, qwen3_proxy_adamw", [])
    assert [(r.recipe, r.overrides, r.label) for r in runs] == [
        ("qwen3_proxy_muon", ["optimizer.lr=1e-2", "optimizer.min_lr=1e-3"], "qwen3_proxy_muon[lr=1e-2,min_lr=1e-3]"),
        ("qwen3_proxy_adamw", [], "qwen3_proxy_adamw"),
    ]


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamx"],
         "error: unknown recipe 'qwen3_proxy_adamx' (did you mean 'qwen3_proxy_adamw'?)"),
        (["--recipes", "qwen3_proxy_muon"], "error: compare needs two or more runs"),
        (["--recipes", "qwen3_proxy_muon:optimizer.lr,qwen3_proxy_adamw"],
         "error: --recipes entry 'qwen3_proxy_muon:optimizer.lr': write RECIPE:KEY=VALUE"),
        (["--recipes", "qwen3_proxy_muon:rng.seed=3,qwen3_proxy_adamw"], "error: --recipes cannot set rng.seed"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_muon"], "error: run qwen3_proxy_muon is listed twice"),
        (["--recipes", "qwen3_8b_muon,qwen3_8b_adamw"], "error: qwen3_8b_muon needs 8 GPUs"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--iters", "0"],
         "error: argument --iters: expected a positive integer, got '0'"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--sweep", "optimizer.lr"],
         "error: --sweep 'optimizer.lr' must look like KEY=V1,V2,..."),
        (["--recipes", "qwen3_proxy_muon", "--sweep", "optimizer.lr=1e-3,2e-3", "--sweep", "optimizer.min_lr=1e-4"],
         "error: --sweep options must have the same number of values"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--sweep", "train.global_batch_size=8,16"],
         "error: --sweep cannot set train.global_batch_size"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "train.train_iters=5"],
         "error: an override cannot set train.train_iters"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--bogus"], "error: unrecognized arguments: --bogus"),
        (["--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--data", "web"],
         "error: argument --data: invalid choice"),
        (["qwen3_proxy_muon", "qwen3_proxy_adamw", "--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw"],
         "error: name the recipes once"),
        ([], "error: name two or more recipes"),
        # fine-tuning recipes
        (["qwen3_proxy_sft_muon", "qwen3_proxy_muon"],
         "error: compare runs pre-training or fine-tuning recipes, not both: qwen3_proxy_sft_muon fine-tunes, "
         "qwen3_proxy_muon pre-trains"),
        (["qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw", "--data", "mock"],
         "error: --data mock is pre-training data; fine-tuning runs take a JSONL file or stdlib-signatures"),
        (["qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw", "--data", "nope.jsonl"],
         "error: data file nope.jsonl does not exist"),
        (["qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw"],
         "error: fine-tuning runs start from a checkpoint: pass checkpoint.pretrained_checkpoint=DIR"),
        (["qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw", "checkpoint.pretrained_checkpoint=nope"],
         "error: checkpoint.pretrained_checkpoint=nope does not exist"),
        (["qwen3_proxy_sft_muon", "qwen3_proxy_sft_adamw", "--sweep", "dataset.seed=1,2"],
         "error: --sweep cannot set dataset.seed"),
        (["qwen3_8b_sft_muon", "qwen3_8b_sft_adamw"], "error: qwen3_8b_sft_muon needs 8 GPUs"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ab"
    assert nemo_llm(["compare", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert err.count("\n") == 1
    assert not out.exists() and not any(tmp_path.iterdir())


def test_out_must_be_empty_or_overwritten(tmp_path, capsys):
    out = tmp_path / "ab"
    out.mkdir()
    (out / "loss.csv").write_text("old")
    argv = ["compare", "--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--out", str(out)]
    assert nemo_llm(argv) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    (out / "notes.txt").write_text("mine")
    assert nemo_llm([*argv, "--overwrite"]) == 2  # never deletes what compare did not write
    assert "holds files compare did not write (notes.txt" in capsys.readouterr().err
    assert (out / "loss.csv").read_text() == "old"
    (out / "notes.txt").unlink()
    file_out = tmp_path / "file"
    file_out.write_text("")
    assert nemo_llm(["compare", "--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--out", str(file_out)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_nemo_cli_routes_compare(tmp_path, capsys):
    assert commands.main(["llm", "compare", "--recipes", "qwen3_proxy_muon,qwen3_proxy_adamx", "--out",
                     str(tmp_path / "ab")]) == 2
    assert "did you mean 'qwen3_proxy_adamw'" in capsys.readouterr().err
    assert commands.main(["llm", "prepare-data", "--bogus"]) == 2


# ------------------------------------------------------------------------------------------- real training
@pytest.mark.slow
@pytest.mark.once  # orchestration only; training on each stack: test_cpu_training, test_attention_logits
def test_compare_trains_two_proxies_on_the_same_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MUON_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "CORPUS_MAX_BYTES", 1_000_000)  # the workers use the same (smaller) corpus
    iters, out = 12, tmp_path / "ab"
    assert nemo_llm(["compare", "--recipes", "qwen3_proxy_muon,qwen3_proxy_adamw", "--iters", str(iters),
                     "--out", str(out), "--smooth", "3", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out

    rows = list(csv.reader((out / "loss.csv").open()))
    assert rows[0] == ["iteration", "qwen3_proxy_muon", "qwen3_proxy_adamw"]
    assert len(rows) == iters + 1
    assert [int(r[0]) for r in rows[1:]] == list(range(1, iters + 1))
    muon = [float(r[1]) for r in rows[1:]]
    adamw = [float(r[2]) for r in rows[1:]]
    for losses in (muon, adamw):
        assert all(math.isfinite(x) for x in losses)
        assert abs(losses[0] - math.log(4096)) < 0.1  # untrained: uniform over the 4096 tokens
        assert sum(losses[-3:]) / 3 < losses[0] - 0.5  # it learns
    # same seed (same initial weights) and same batches: identical first loss; the optimizers then diverge
    assert muon[0] == adamw[0]
    assert muon != adamw

    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_run"] == iters * 8 * 128
    assert set(summary["runs"]) == {"qwen3_proxy_muon", "qwen3_proxy_adamw"}
    assert "standard library" in summary["data"]
    slowest = summary["slowest"]
    assert summary["runs"][slowest]["iterations_to_target"] is not None
    for label in ("qwen3_proxy_muon", "qwen3_proxy_adamw"):
        assert label in printed
        assert summary["runs"][label]["final_loss"] == pytest.approx(float(rows[-1][1 + ("adamw" in label)]),
                                                                     abs=1e-6)
        records = [json.loads(line) for line in (out / "runs" / label / "losses.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records if "iteration" in r] == list(range(1, iters + 1))
        assert records[-1]["done"] is True
