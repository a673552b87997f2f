"""``nemo llm generate``: greedy text from a Megatron checkpoint equals, token for token, transformers' own greedy
``generate()`` on the same checkpoint exported by ``nemo llm export``, for every proxy family (Qwen3 dense, Qwen3-MoE,
Kimi K2 MLA + MoE, Moonlight), the prompts decoded together in one KV-cached batch; the same loop over the HF
directory; streaming, JSONL, sampling; bad input in one line.

Each family trains 2 iterations once per test process and is exported once (tests/evaluate_generate_runs.py, shared
with tests/test_evaluate.py); Kimi K2 is the run ``make demo`` makes, cut to 2 iterations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import evaluate_generate_runs as shared
import hf_fixtures

PROMPTS = ["def main(", "import os\nclass ", "    return self."]
NEW = 12

# family -> the shared run trained for it
FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "kimi_k2": "demo", "moonlight": "moonlight"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def get(family: str) -> dict[str, Path]:
        name = FAMILIES[family]
        return {"ckpt": shared.trained(tmp_path_factory, name), "hf": shared.exported(tmp_path_factory, name)}

    return get


transformers_greedy = shared.transformers_greedy


def _generate_jsonl(nemo, source: list, tmp_path: Path, *extra) -> list[dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / f"out-{source[0].strip('-')}.jsonl"
    result = nemo(["llm", "generate", *source, "--prompts", prompts, "--out", out, "--max-new-tokens", NEW, *extra])
    assert result.code == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _greedy_equals_transformers(nemo, runs, family: str, tmp_path: Path) -> None:
    run = runs(family)
    megatron = _generate_jsonl(nemo, ["--ckpt", run["ckpt"]], tmp_path)
    hf = _generate_jsonl(nemo, ["--hf", run["hf"]], tmp_path)
    for prompt, m, h, reference in zip(PROMPTS, megatron, hf, transformers_greedy(run["hf"], PROMPTS, NEW),
                                       strict=True):
        assert m["tokens"] == reference, (family, prompt)
        assert h["tokens"] == reference, (family, prompt)
        assert m["prompt"] == prompt and m["text"] == h["text"]
        assert m["stop"] in ("eos", "max_new_tokens") and len(m["tokens"]) <= NEW


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "kimi_k2"])
def test_greedy_megatron_equals_transformers_on_the_export(nemo, runs, family, tmp_path):
    _greedy_equals_transformers(nemo, runs, family, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "moonlight"])
def test_greedy_megatron_equals_transformers_moe_families(nemo, runs, family, tmp_path):
    _greedy_equals_transformers(nemo, runs, family, tmp_path)


@pytest.mark.once  # the stream and the sampler are ours; a stream on every stack: test_evaluate's make-demo test
@pytest.mark.slow
def test_streams_one_prompt_and_samples_reproducibly(nemo, runs, tmp_path):
    run = runs("qwen3")
    result = nemo(["llm", "generate", "--ckpt", run["ckpt"], "--prompt", "def main(", "--max-new-tokens", NEW])
    assert result.code == 0, result.stderr[-3000:]
    greedy = transformers_greedy(run["hf"], "def main(", NEW)
    from bridge_ext.tokenizers import load_tokenizer

    assert result.stdout == "def main(" + load_tokenizer(run["hf"]).decode(greedy) + "\n"
    assert "[Gloo]" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("generate: ") and " iteration 2 from " in last and last.endswith("; greedy")
    sampled = [_generate_jsonl(nemo, ["--ckpt", run["ckpt"]], tmp_path, "--temperature", "1.5", "--top-k", "50",
                               "--top-p", "0.95", "--seed", str(seed)) for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1]  # the seed fixes the draw
    assert sampled[0] != sampled[2]


@pytest.mark.once
@pytest.mark.slow
def test_decodes_up_to_the_models_context(nemo, runs, tmp_path):
    """A prompt 8 tokens short of the context (128) in one batch with a short one: the long one fills the KV cache
    to its last position and stops there, each equal to transformers' greedy."""
    from bridge_ext.tokenizers import load_tokenizer

    run = runs("qwen3")
    tok = load_tokenizer(run["hf"])
    long_prompt = tok.decode(tok.encode("x" + " x" * 200)[:120])
    assert len(tok.encode(long_prompt)) == 120
    rows = _generate_lines(nemo, run["ckpt"], [long_prompt, "def main("], tmp_path, 20)
    assert rows[0]["stop"] == "context" and len(rows[0]["tokens"]) == 8
    assert rows[0]["tokens"] == transformers_greedy(run["hf"], long_prompt, 8)
    assert rows[1]["tokens"] == transformers_greedy(run["hf"], "def main(", 20)


def _generate_lines(nemo, ckpt: Path, prompts: list[str], tmp_path: Path, new: int) -> list[dict]:
    path = tmp_path / "context.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = nemo(["llm", "generate", "--ckpt", ckpt, "--prompts", path, "--json", "--max-new-tokens", new])
    assert result.code == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.strip().splitlines()]


@pytest.mark.stack
@pytest.mark.slow
def test_refuses_bad_input_with_the_model_at_hand(nemo, runs, tmp_path):
    run = runs("qwen3")
    long_prompt = " ".join(["x"] * 400)  # the proxies' context is 128 tokens
    result = nemo(["llm", "generate", "--ckpt", run["ckpt"], "--prompt", long_prompt])
    assert result.code == 2 and "the model's context is 128" in result.stderr and "Traceback" not in result.stderr
    wrong = tmp_path / "tok"
    hf_fixtures.write_tokenizer(wrong, vocab_size=8000)
    for source in (["--ckpt", run["ckpt"]], ["--hf", run["hf"]]):
        result = nemo(["llm", "generate", *source, "--tokenizer", wrong, "--prompt", "w1 w2"])
        assert result.code == 2, result.stderr[-2000:]
        assert "8,000 tokens" in result.stderr and "another model's tokenizer" in result.stderr
    result = nemo(["llm", "generate", "--ckpt", run["ckpt"], "--iteration", "7", "--prompt", "x"])
    assert result.code == 2 and "--iteration 7 not found" in result.stderr


@pytest.mark.once
def test_refuses_bad_input_before_loading_anything(nemo, tmp_path):
    cases = [
        (["--ckpt", tmp_path / "nothing", "--prompt", "x"], "does not exist"),
        (["--hf", tmp_path, "--prompt", "x"], "not a Hugging Face model directory"),
        (["--ckpt", tmp_path, "--prompts", tmp_path / "none.jsonl"], "does not exist"),
        (["--ckpt", tmp_path, "--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--ckpt", tmp_path, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--hf", tmp_path, "--iteration", "3", "--prompt", "x"], "--iteration applies to --ckpt"),
        (["--prompt", "x"], "one of the arguments --ckpt --hf is required"),
    ]
    for argv, expected in cases:
        result = nemo(["llm", "generate", *argv])
        assert result.code == 2, (argv, result.stderr)
        assert expected in result.stderr, (argv, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
