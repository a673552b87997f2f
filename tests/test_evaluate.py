"""``nemo llm evaluate``: the held-out loss Megatron Bridge's own evaluation gives a saved checkpoint equals what
the training loop's validation printed at that iteration on the same data; ``--all`` and several ``--ckpt`` (a Muon
run and its AdamW twin) in one table, one CSV and one PNG; bad input in one line. ``--choices``: every choice's
log-likelihood equals transformers' on the export, acc / acc_norm the arg-max by hand. ``--data mock`` and a file
tokenized on the fly (= its prepare-data prefix). Both commands on a checkpoint made as ``make demo`` makes it and on
a checkpoint imported from HF, on every stack.

The checkpoints (a Muon run and its AdamW twin, 2 iterations saved and validated at 1 and 2; the demo run; the
import) are made once per test process by tests/evaluate_generate_runs.py, shared with tests/test_generate.py.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

import evaluate_generate_runs as shared


class _Runs:
    """``runs["muon"]`` / ``runs["adamw"]``: the shared Qwen3 proxy runs, trained when a test first asks."""

    def __init__(self, factory):
        self.factory = factory

    def __getitem__(self, key: str) -> Path:
        return shared.trained(self.factory, {"muon": "qwen3", "adamw": "adamw"}[key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory)


printed_validation = shared.printed_validation


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


# ------------------------------------------------------------------------------------------ --choices (issue 40)
CHOICES = [
    {"context": "def main(", "choices": ["self", "x, y", "argv"], "label": 0},
    {"context": "import ", "choices": ["os", "sys", "json"], "label": 1},  # the trailing space moves to the choice
    {"context": "for i in", "choices": [" range(10):", " items:", " é"], "label": 0},
    {"context": "", "choices": ["import os", "class A:"], "label": 1},  # empty: the end-of-text token is the context
    {"context": "x = [1, 2, 3]\nprint(", "choices": ["len(x))", "x[0])"], "label": 1},
]


def _write_choices(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def transformers_choice_scores(hf: Path, records: list[dict]) -> list[list[float]]:
    """The reference, independent of bridge_ext.evaluate: lm-evaluation-harness's _encode_pair and its scoring
    (sum of the continuation tokens' log_softmax, gathered) with transformers on the export."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext.hf import load_hf_config
    from bridge_ext.tokenizers import load_tokenizer

    tok = load_tokenizer(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, config=load_hf_config(hf), dtype=torch.float32)
    model.eval()
    out = []
    for record in records:
        sums = []
        for choice in record["choices"]:
            context, continuation = record["context"], choice
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = tok.encode(context + continuation)
            context_ids = tok.encode(context)
            continuation_ids = whole[len(context_ids):]
            ids = (context_ids or [tok.eod]) + continuation_ids
            with torch.no_grad():
                logits = model(torch.tensor([ids[:-1]])).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)[-len(continuation_ids):]
            sums.append(float(logprobs.gather(-1, torch.tensor(continuation_ids).unsqueeze(-1)).sum()))
        out.append(sums)
    return out


@pytest.mark.once  # the scoring is ours; the model's forward on every stack: tests/test_generate.py
@pytest.mark.slow
def test_choices_equal_transformers_log_likelihoods_on_the_export(nemo, runs, tmp_path):
    hf = tmp_path / "hf"
    assert nemo(["llm", "export", "--ckpt", runs["muon"], "--out", hf]).code == 0
    choices = _write_choices(tmp_path / "mc.jsonl", CHOICES)
    result = nemo(["llm", "evaluate", "--ckpt", runs["muon"], "--choices", choices, "--json"])
    assert result.code == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    per_record, summary = lines[:-1], lines[-1]
    assert [r["line"] for r in per_record] == [1, 2, 3, 4, 5] and summary["records"] == 5
    reference = transformers_choice_scores(hf, CHOICES)
    for record, row, expected in zip(CHOICES, per_record, reference, strict=True):
        assert row["iteration"] == 2 and row["label"] == record["label"]
        assert row["loglikelihoods"] == pytest.approx(expected, abs=1e-4)
        assert row["bytes"] == [len(c.encode()) for c in record["choices"]]
        assert row["pred"] == max(range(len(expected)), key=lambda i: expected[i])
        normed = [s / len(c.encode()) for s, c in zip(expected, record["choices"])]
        assert row["pred_norm"] == max(range(len(normed)), key=lambda i: normed[i])
    by_hand = [max(range(len(e)), key=lambda i: e[i]) == r["label"] for r, e in zip(CHOICES, reference)]
    by_hand_norm = [max(range(len(e)), key=lambda i: e[i] / len(r["choices"][i].encode())) == r["label"]
                    for r, e in zip(CHOICES, reference)]
    assert summary["acc"] == pytest.approx(sum(by_hand) / 5)
    assert summary["acc_norm"] == pytest.approx(sum(by_hand_norm) / 5)
    table = nemo(["llm", "evaluate", "--ckpt", runs["muon"], "--choices", choices])
    assert table.code == 0 and f"acc {summary['acc']:.4f}, acc_norm {summary['acc_norm']:.4f}" in table.stdout


@pytest.mark.once
def test_choices_refuse_a_malformed_record_naming_file_and_line(nemo, tmp_path):
    good = json.dumps(CHOICES[0])
    cases = [
        ('{"context": "a", "choices": ["b"]}', "no 'label'"),
        ('{"choices": ["b"], "label": 0}', "no 'context'"),
        ('{"context": "a", "choices": ["b", "c"], "label": 2}', "label 2 is not an index into its 2 choices"),
        ('{"context": "a", "choices": [], "label": 0}', "choices must be a non-empty list"),
        ('not json', "not JSON"),
    ]
    for line, expected in cases:
        path = tmp_path / "mc.jsonl"
        path.write_text(f"{good}\n\n{line}\n")
        result = nemo(["llm", "evaluate", "--ckpt", tmp_path / "no-checkpoint", "--choices", path])
        assert result.code == 2, (line, result.stderr)
        assert f"{path}:3: {expected}" in result.stderr, (line, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    result = nemo(["llm", "evaluate", "--ckpt", tmp_path, "--choices", tmp_path / "mc.jsonl", "--data", "mock"])
    assert result.code == 2 and "--data does not apply to --choices" in result.stderr


# ------------------------------------------------------------------------------- --data mock / a file (issue 40)
def _loss(nemo, *argv) -> dict:
    result = nemo(["llm", "evaluate", *argv, "--json"])
    assert result.code == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


HELD_OUT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(60))


@pytest.mark.stack
@pytest.mark.slow
def test_mock_data_gives_a_finite_loss(nemo, runs):
    row = _loss(nemo, "--ckpt", runs["muon"], "--data", "mock")
    assert math.isfinite(row["loss"]) and 0 < row["loss"] < 20 and row["data"].startswith("mock data (Megatron's")
    assert row["eval_tokens"] == 8 * 128  # the run's eval_iters=1 global batch of 8 x 128


@pytest.mark.stack
@pytest.mark.slow
def test_a_text_file_tokenized_on_the_fly_equals_its_prepare_data_prefix(nemo, runs, tmp_path):
    text = tmp_path / "held.txt"
    text.write_text(HELD_OUT)
    from bridge_ext.data import PROXY_TOKENIZER_DIR

    prefix = tmp_path / "prepared" / "held"
    result = nemo(["llm", "prepare-data", "--input", text, "--tokenizer", PROXY_TOKENIZER_DIR, "--out", prefix,
                   "--append-eod", "--quiet"])
    assert result.code == 0, result.stderr[-2000:]
    on_the_fly = _loss(nemo, "--ckpt", runs["muon"], "--data", text)
    prepared = _loss(nemo, "--ckpt", runs["muon"], "--data", prefix, "--split", "0,1,0")
    assert math.isfinite(on_the_fly["loss"]) and "all of it (0,1,0)" in on_the_fly["data"]
    assert on_the_fly["loss"] == prepared["loss"]  # the same tokens, the same batches, the same forward


@pytest.mark.once  # reading a JSONL file is ours: the same document as the text file, the same loss
@pytest.mark.slow
def test_a_jsonl_file_of_one_document_equals_the_same_text(nemo, runs, tmp_path):
    text = tmp_path / "held.txt"
    text.write_text(HELD_OUT)
    jsonl = tmp_path / "held.jsonl"
    jsonl.write_text(json.dumps({"text": HELD_OUT}) + "\n")
    assert _loss(nemo, "--ckpt", runs["muon"], "--data", jsonl)["loss"] == _loss(nemo, "--ckpt", runs["muon"],
                                                                                "--data", text)["loss"]


# ------------------------------------------------- a checkpoint as `make demo` makes it, an imported HF proxy
@pytest.mark.stack
@pytest.mark.slow
def test_both_commands_on_a_checkpoint_made_as_make_demo_makes_it(nemo, tmp_path_factory):
    """The Makefile's own demo command line (Kimi K2 proxy, Muon with QK-clip, the shipped text), 2 iterations and a
    validation pass at the end: evaluate = what that pass printed; generate (streamed, greedy) = transformers'
    greedy on the checkpoint's export (the generate tests' Kimi K2 family uses this same run)."""
    ckpt = shared.trained(tmp_path_factory, "demo")
    printed = printed_validation(ckpt)
    assert sorted(printed) == [2]
    row = _loss(nemo, "--ckpt", ckpt)
    assert row["iteration"] == 2 and row["data"].startswith("the run's data, validation split")
    loss, ppl = printed[2][0]
    assert f"{row['loss']:.6E}" == loss and f"{math.exp(row['loss']):.6E}" == ppl
    prompt = "def main("
    result = nemo(["llm", "generate", "--ckpt", ckpt, "--prompt", prompt, "--max-new-tokens", 12])
    assert result.code == 0, result.stderr[-3000:]
    hf = shared.exported(tmp_path_factory, "demo")
    from bridge_ext.tokenizers import load_tokenizer

    assert result.stdout == prompt + load_tokenizer(hf).decode(shared.transformers_greedy(hf, prompt, 12)) + "\n"


def transformers_loss(hf: Path, ids: list[int]) -> float:
    """The reference, independent of evaluate: transformers' mean next-token cross-entropy over one sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].double()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])))


@pytest.mark.stack
@pytest.mark.slow
def test_both_commands_on_a_checkpoint_imported_from_hf(nemo, tmp_path_factory, tmp_path):
    """evaluate on a text file = transformers' loss on the HF source; generate (a batch of two prompts) =
    transformers' greedy on the HF source."""
    import hf_fixtures

    from bridge_ext.tokenizers import load_tokenizer

    run = shared.imported(tmp_path_factory)
    # One document of 31 words + its end-of-document token = 32 tokens, which divide the model's 256-token
    # sequences: GPTDataset cuts the repeated document into windows of 257 tokens starting every 256, so every
    # window starts at the document's start, whatever its shuffle: each held-out sequence is the same one.
    words = " ".join(f"w{3 + (i * 37) % 250}" for i in range(31))
    (tmp_path / "doc.txt").write_text(words)
    tok = load_tokenizer(run["hf"])
    document = tok.encode(words) + [tok.eod]
    seq = hf_fixtures.QWEN3_TINY["max_position_embeddings"]
    assert len(document) == 32 and seq % 32 == 0
    row = _loss(nemo, "--ckpt", run["ckpt"], "--data", tmp_path / "doc.txt")
    assert row["iteration"] == 0 and row["eval_tokens"] == 16 * seq  # 16 batches of one sequence
    assert row["loss"] == pytest.approx(transformers_loss(run["hf"], (document * (seq // 32 + 1))[: seq + 1]),
                                        abs=1e-5)
    prompts = ["w5 w17 w40 w3", "w9"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = nemo(["llm", "generate", "--ckpt", run["ckpt"], "--prompts", tmp_path / "prompts.jsonl", "--json",
                   "--max-new-tokens", "8"])
    assert result.code == 0, result.stderr[-3000:]
    got = [json.loads(line)["tokens"] for line in result.stdout.strip().splitlines()]
    assert got == shared.transformers_greedy(run["hf"], prompts, 8)


@pytest.mark.once  # the refusal is ours; mock data on every stack: test_mock_data_gives_a_finite_loss
@pytest.mark.slow
def test_an_import_has_no_data_of_its_own_and_takes_mock_data(nemo, tmp_path_factory):
    run = shared.imported(tmp_path_factory)
    result = nemo(["llm", "evaluate", "--ckpt", run["ckpt"]])
    assert result.code == 2 and "no data of its own" in result.stderr and "--data" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    mock = _loss(nemo, "--ckpt", run["ckpt"], "--data", "mock")
    assert math.isfinite(mock["loss"]) and mock["iteration"] == 0 and mock["eval_tokens"] == 16 * 256
