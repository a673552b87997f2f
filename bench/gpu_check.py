"""The GPU tier: what only a GPU can check, in one command on one GPU (H200, ~139 GiB), under 8 minutes.

    bench/gpu_check.sh                 # installs the carried wheels if the stack is absent, then this script
    python bench/gpu_check.py --dry-run   # CPU: prints each step, checks every recipe and layout it names

Steps (each in its own process, so one failure leaves the others' numbers):

1. ``env``: GPU, driver, PyTorch/CUDA, the Megatron stack and Transformer Engine; a bf16 8192^3 matmul's
   TFLOP/s (the machine's ceiling, measured here).
2. ``proxies``: the Kimi K2, Moonlight and Qwen3-MoE proxies, Muon and AdamW, 50 iterations each on the shipped
   text corpus, bf16 on the GPU (layout ``h200x1``), run side by side. Loss curves are compared with
   ``tests/gpu/reference/proxy_curves.json``; when that file is absent the curves are written to
   ``$OUT/proxy_curves.json`` and the run says so (commit it as the reference).
3. ``qwen3_0p6b``: the shipped Qwen3-0.6B config with random weights (layout ``h200x1``: 16 x 4K tokens per step),
   Muon and AdamW one after the other: step time, model TFLOP/s (Megatron Bridge's own FLOP count), the
   optimizer step's time and Newton-Schulz's share of the step (CUDA events around each), peak memory.
4. ``rehearse``: ``nemo llm rehearse --device cuda`` of that recipe and layout beside the real run's
   ``torch.cuda.max_memory_allocated()`` (ratio), and ``nemo llm plan``'s total.

Writes ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.md`` (the table for docs/launch.md); each run's log, losses
and dataset cache go to ``--work-dir`` (default ``$OUT/work``).
Where Transformer Engine is not installed the GPU runs take megatron-core's local spec (``bridge_ext.without_te``)
and the table says so.

``--te`` (TE installed by ``bench/te/te.py``): the same steps on TE's layer specs, then ``te_probe``, the fp8 rows,
QK-clip on TE attention (MLA, GQA) and the import -> step -> export round trip (docs/launch.md, "The TE path on the
lent GPU"); ``--te --dry-run`` checks every config on CPU without importing TE. The QK-clip and round-trip checks
are ``bench/te/workers.py`` (``--spec te|local``, ``--device cuda|cpu``); ``--te --rehearse --only qk_clip,round_trip``
runs them on CPU with the local spec (no GPU, no TE; ``--recipe NAME`` keeps one recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_tier.driver import rehearse_te_workers, run_checks  # noqa: E402  (bench/ is this script's directory)
from gpu_tier.dry_run import dry_run  # noqa: E402
from gpu_tier.worker import worker_env, worker_train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu")
    p.add_argument("--dry-run", action="store_true", help="print the steps, check their recipes and layouts (CPU)")
    p.add_argument("--te", action="store_true", help="the Transformer Engine path: TE specs, fp8 rows, QK-clip, "
                                                     "round trip (needs transformer_engine; bench/te/te.py)")
    p.add_argument("--iters", type=int, default=50, help="proxy iterations")
    p.add_argument("--steps", type=int, default=12, help="Qwen3-0.6B iterations (the first 3 are not timed)")
    p.add_argument("--only", default="env,proxies,qwen3_0p6b,rehearse")
    p.add_argument("--work-dir", help="runs' logs, losses and dataset caches (default: OUT/work)")
    p.add_argument("--rehearse", action="store_true",
                   help="with --te: the QK-clip and round-trip workers on CPU, local spec (--only qk_clip,round_trip; "
                        "--recipe NAME keeps one recipe)")
    p.add_argument("--worker", choices=("env", "train"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--data", default="text", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = worker_env() if args.worker == "env" else worker_train(
            args.recipe, iters=args.iters, data=args.data, work=Path(args.work), timed=args.timed,
            device=args.device, precision=args.precision)
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(json.dumps(result, default=str))
        return 0
    if args.dry_run:
        return dry_run(iters=args.iters, steps=args.steps, te=args.te)
    if args.rehearse:
        return rehearse_te_workers(Path(args.out), only=set(args.only.split(",")),
                                   work=Path(args.work_dir) if args.work_dir else None,
                                   recipes={args.recipe} if args.recipe else None)
    import torch

    if not torch.cuda.is_available():
        print("error: no GPU visible; `bench/gpu_check.sh --dry-run` checks the steps on CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    if args.te:
        from bridge_ext.stack import have_transformer_engine

        if not have_transformer_engine():
            print("error: --te needs transformer_engine (bench/te/te.py install; TE_SITE on PYTHONPATH)",
                  file=sys.stderr)
            return 2
        if args.only == p.get_default("only"):
            only |= {"te_probe", "fp8", "qk_clip", "round_trip"}
    results = run_checks(out, iters=args.iters, steps=args.steps, only=only,
                         work=Path(args.work_dir) if args.work_dir else out / "work", te=args.te)
    failed = [k for k in ("env", "rehearse") if k in results and not results[k].get("ok")]
    failed += [n for part in ("proxies", "qwen3_0p6b", "fp8", "qk_clip", "round_trip")
               for n, r in results.get(part, {}).items() if not r.get("ok")]
    failed += [n for n, r in results.get("fp8", {}).items() if r.get("reference") and not r["reference"]["match"]]
    if "te_probe" in results and not results["te_probe"].get("ok"):
        failed.append("te_probe")
    failed += [n for n, r in results.get("proxies", {}).items() if r.get("reference") and not r["reference"]["match"]]
    if failed:
        print(f"gpu check: not passed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
