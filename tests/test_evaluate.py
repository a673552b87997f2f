"""``nemo llm evaluate``: the held-out loss Megatron Bridge's own evaluation gives a saved checkpoint equals what
the training loop's validation printed at that iteration on the same data; ``--all`` and several ``--ckpt`` (a Muon
run and its AdamW twin) in one table, one CSV and one PNG; bad input in one line. ``--choices``: every choice's
log-likelihood equals transformers' on the export, acc / acc_norm the arg-max by hand. ``--data mock`` and a file
tokenized on the fly (= its prepare-data prefix); a checkpoint imported from HF: evaluate and generate.

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
    jsonl = tmp_path / "held.jsonl"
    jsonl.write_text(json.dumps({"text": HELD_OUT}) + "\n")
    from bridge_ext.data import PROXY_TOKENIZER_DIR

    prefix = tmp_path / "prepared" / "held"
    result = nemo(["llm", "prepare-data", "--input", text, "--tokenizer", PROXY_TOKENIZER_DIR, "--out", prefix,
                   "--append-eod", "--quiet"])
    assert result.code == 0, result.stderr[-2000:]
    on_the_fly = _loss(nemo, "--ckpt", runs["muon"], "--data", text)
    prepared = _loss(nemo, "--ckpt", runs["muon"], "--data", prefix, "--split", "0,1,0")
    assert math.isfinite(on_the_fly["loss"]) and "all of it (0,1,0)" in on_the_fly["data"]
    assert on_the_fly["loss"] == prepared["loss"]  # the same tokens, the same batches, the same forward
    assert _loss(nemo, "--ckpt", runs["muon"], "--data", jsonl)["loss"] == on_the_fly["loss"]  # one document


# ------------------------------------------------------------------------------ an imported HF proxy (issue 40)
@pytest.mark.once
@pytest.mark.slow
def test_evaluate_and_generate_on_a_checkpoint_imported_from_hf(nemo, tmp_path):
    import hf_fixtures

    hf = hf_fixtures.qwen3_dir(tmp_path / "hf")
    ckpt = tmp_path / "mg"
    assert nemo(["llm", "import", "--hf", hf, "--out", ckpt]).code == 0
    result = nemo(["llm", "evaluate", "--ckpt", ckpt])
    assert result.code == 2 and "no data of its own" in result.stderr and "--data" in result.stderr
    mock = _loss(nemo, "--ckpt", ckpt, "--data", "mock")
    assert math.isfinite(mock["loss"]) and mock["iteration"] == 0
    words = tmp_path / "words.txt"
    words.write_text(" ".join(f"w{3 + (i * 7) % 250}" for i in range(2000)))
    text = _loss(nemo, "--ckpt", ckpt, "--data", words)
    assert math.isfinite(text["loss"]) and text["loss"] != mock["loss"]
    # generate: greedy from the imported checkpoint = transformers' greedy on the HF source
    import torch
    from transformers import AutoModelForCausalLM

    from bridge_ext.tokenizers import load_tokenizer

    prompt = "w5 w17 w40 w3"
    tok = load_tokenizer(hf)
    ids = torch.tensor([tok.encode(prompt)])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eod, pad_token_id=tok.eod,
                               attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": prompt}) + "\n")
    result = nemo(["llm", "generate", "--ckpt", ckpt, "--prompts", prompts, "--json", "--max-new-tokens", "8"])
    assert result.code == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["tokens"] == reference
