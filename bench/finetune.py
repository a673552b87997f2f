"""Muon vs AdamW fine-tuning on the CPU proxies: full SFT and LoRA, two seeds, held-out eval loss.

    python bench/finetune.py --out runs/ft-bench            # ~16 fine-tuning runs + 2 pre-training runs

For each proxy: its ``<proxy>_muon`` pre-training recipe (default length) makes the base checkpoint; then
``<proxy>_{sft,lora}_{muon,adamw}`` fine-tune it on the shipped instruction set (``--data
stdlib-signatures``) with each seed (``rng.seed``: LoRA's initialization; ``dataset.seed``: the order of the
training records, docs/finetune.md "Data order"). The held-out loss (the same 64 records every pass) is read
from each run's ``eval.jsonl``. Prints a Markdown table (docs/finetune.md) and writes ``results.json``. Every
run goes through ``nemo llm`` itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("sft_muon", "sft_adamw", "lora_muon", "lora_adamw")


def nemo(*argv: str) -> None:
    result = subprocess.run([sys.executable, "-m", "bridge_ext.commands", "llm", *argv], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode:
        sys.exit(f"nemo llm {' '.join(argv)} failed:\n{result.stderr[-2000:]}")


def evals(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "eval.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["iteration"]] = record["eval_loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--proxies", default="qwen3_proxy,kimi_k2_proxy")
    parser.add_argument("--seeds", default="1234,5678")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    for proxy in args.proxies.split(","):
        base = out / "pretrain" / proxy
        if not (base / "latest_checkpointed_iteration.txt").is_file():
            nemo("pretrain", "--recipe", f"{proxy}_muon", f"checkpoint.save={base}", f"checkpoint.load={base}")
        results[proxy] = {}
        for recipe in RECIPES:
            results[proxy][recipe] = {}
            for seed in seeds:
                run = out / "finetune" / f"{proxy}_{recipe}_s{seed}"
                if not (run / "eval.jsonl").is_file() or 40 not in evals(run):
                    start = time.time()
                    nemo("finetune", "--recipe", f"{proxy}_{recipe}", "--data", "stdlib-signatures",
                         f"checkpoint.pretrained_checkpoint={base}", f"checkpoint.save={run}",
                         f"checkpoint.load={run}", f"rng.seed={seed}", f"dataset.seed={seed}")
                    print(f"{proxy}_{recipe} seed {seed}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
                results[proxy][recipe][seed] = evals(run)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| proxy | recipe | held-out loss at 10 | at 20 | at 30 | at 40 (final) | seeds |")
    print("|---|---|---|---|---|---|---|")
    for proxy, by_recipe in results.items():
        for recipe, by_seed in by_recipe.items():
            cells = []
            for step in (10, 20, 30, 40):
                values = [e[step] for e in by_seed.values() if step in e]
                cells.append(f"{statistics.mean(values):.3f} ± {abs(values[0] - values[-1]) / 2:.3f}")
            print(f"| {proxy} | `{proxy}_{recipe}` | {' | '.join(cells)} | {len(by_seed)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
