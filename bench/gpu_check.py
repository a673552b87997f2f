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
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROXIES = ("kimi_k2_proxy", "moonlight_proxy", "qwen3_moe_proxy")
PRESETS = ("muon", "adamw")
DENSE = "qwen3_0p6b"
LAYOUT = "h200x1"
REFERENCE = REPO / "tests" / "gpu" / "reference" / "proxy_curves.json"
# bf16 runs are not bit-reproducible (atomics in backward kernels): a curve matches its reference when the mean
# absolute difference over the run is under this, and the last-10 mean within 3 %.
CURVE_MEAN_ABS_TOL = 0.05
CURVE_TAIL_REL_TOL = 0.03
# --te: the same curves on Transformer Engine's layer specs against the *local-spec* reference. Not the same
# kernels (cuDNN fused attention vs SDPA / unfused softmax, TE grouped GEMM vs SequentialMLP experts, fused RoPE,
# cross-entropy and norms), so the bf16 rounding differs from the first step and the noisy 8 x 128-token curves
# (the reference swings by up to 0.5 between iterations) drift apart: a wider band that still catches a broken
# path (a wrong spec, unclipped logits, a mis-split fused weight shows as a curve 0.5-2 nats off). Provisional:
# set from these reasons, not yet from a measured TE-vs-local spread (docs/launch.md).
TE_CURVE_MEAN_ABS_TOL = 0.25
TE_CURVE_TAIL_REL_TOL = 0.05
# fp8 (Hopper's delayed / current scaling) on top: E4M3 forward GEMMs add ~1e-2 relative error per GEMM.
FP8_CURVE_MEAN_ABS_TOL = 0.35
FP8_CURVE_TAIL_REL_TOL = 0.08
# Layouts that ask for fp8 ask for MXFP8 (Blackwell): kimi_k2 (gb300x256), qwen3_30b_a3b (gb300x8). Hopper has
# no MXFP8; their proxies run the two fp8 recipes Hopper has, each a row of its own.
FP8_PROXIES = ("kimi_k2_proxy", "qwen3_moe_proxy")
FP8_PRECISIONS = ("bf16_with_fp8_delayed_scaling_mixed", "bf16_with_fp8_current_scaling_mixed")
# QK-clip and the max-logit telemetry on TE's attention: MLA (Kimi K2) and GQA (Qwen3); after a clip the max
# logit of the same batch must be <= tau.
QK_CLIP_RECIPES = {"kimi_k2_proxy_muon": "MLA", "qwen3_proxy_muon": "GQA"}
# The proxies' logits start near 0.1: bench/te/workers.py scales a few heads' initial query weights so that they start
# at 40-120 and the clip acts from step 1; tau low so that the clipped heads stay at it while the rest train freely.
QK_CLIP_TAU = 5.0
QK_CLIP_ITERS = 5
# HF import -> one training step -> export, TE spec vs local spec, in fp32 (TF32 off): the same weights within the
# summation-order noise of one step. bf16 would not do: one bf16 ulp of a weight is about half of the step's
# per-element update, so rounding flips alone would be ~5-10 % of the update (bench/te/workers.py).
ROUND_TRIP_RECIPES = ("qwen3_proxy_muon", "kimi_k2_proxy_muon")
ROUND_TRIP_REL_TOL = 2e-2  # per tensor: ||te - local|| / ||local - imported||, i.e. of the step's own update


def plan_steps(*, iters: int, steps: int, te: bool = False) -> list[dict[str, Any]]:
    """Every step the check runs, with the recipe and layout each names (what ``--dry-run`` prints and checks).
    ``te``: the same on Transformer Engine's layer specs, plus the fp8 rows, QK-clip and the round trip."""
    out: list[dict[str, Any]] = [{"step": "env", "what": "GPU, stack, Transformer Engine, bf16 matmul ceiling"}]
    if te:
        out.append({"step": "te_probe", "what": "bench/te/probe.py: import, te.Linear fwd/bwd, fused attention"})
    for model in PROXIES:
        for preset in PRESETS:
            out.append({"step": "proxies", "recipe": f"{model}_{preset}", "layout": LAYOUT, "iters": iters,
                        "what": f"{iters} iterations, text corpus, bf16, loss curve vs reference"})
    for preset in PRESETS:
        out.append({"step": "qwen3_0p6b", "recipe": f"{DENSE}_{preset}", "layout": LAYOUT, "iters": steps,
                    "what": "step time, model TFLOP/s, optimizer step, Newton-Schulz share, peak memory"})
    out.append({"step": "rehearse", "recipe": f"{DENSE}_muon", "layout": LAYOUT,
                "what": "nemo llm rehearse --device cuda and nemo llm plan beside the real run's peak memory"})
    if not te:
        return out
    for step in out:
        if step["step"] == "proxies":
            step["what"] += f" (local-spec reference; TE band {TE_CURVE_MEAN_ABS_TOL}/{TE_CURVE_TAIL_REL_TOL:.0%})"
    for model in FP8_PROXIES:
        for precision in FP8_PRECISIONS:
            out.append({"step": "fp8", "recipe": f"{model}_muon", "layout": LAYOUT, "iters": iters,
                        "precision": precision, "what": f"{precision}: loss curve vs the bf16 reference "
                                                        f"({FP8_CURVE_MEAN_ABS_TOL}/{FP8_CURVE_TAIL_REL_TOL:.0%})"})
    for recipe, kind in QK_CLIP_RECIPES.items():
        out.append({"step": "qk_clip", "recipe": recipe, "layout": LAYOUT, "iters": QK_CLIP_ITERS, "attention": kind,
                    "what": f"{kind} on TE attention{' (QK-norm off)' if kind == 'GQA' else ''}: kernel max logit "
                            f"logged; after the last clip max logit <= tau={QK_CLIP_TAU} (+5 %)"})
    for recipe in ROUND_TRIP_RECIPES:
        out.append({"step": "round_trip", "recipe": recipe, "layout": LAYOUT, "iters": 1,
                    "what": f"HF import -> 1 step (fp32) -> export on the TE spec vs the local spec "
                            f"(rel {ROUND_TRIP_REL_TOL:g} of the step's update)"})
    return out


def step_values(step: dict[str, Any]) -> dict[str, Any]:
    """Config overrides a --te step trains with (the dry run builds the same)."""
    if "precision" in step:
        return {"mixed_precision": step["precision"]}
    if step["step"] == "qk_clip":  # Qwen3's recipes leave QK-clip off: turned on here, tau low enough to clip
        values = {"model.qk_clip": True, "model.qk_clip_threshold": QK_CLIP_TAU, "model.log_max_attention_logit": True}
        if step.get("attention") == "GQA":  # QK-norm undoes any scaling of W_q / W_k: no weight-level clip can act
            values["model.qk_layernorm"] = False  # under it (docs/muon.md); GQA's clip is checked without it
        return values
    return {}


# ---------------------------------------------------------------------------------------------------------
# Workers (each a process of its own: python bench/gpu_check.py --worker KIND ...)
# ---------------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """torchrun's variables for one process, so Megatron Bridge's initialization makes an NCCL group of one."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def worker_env() -> dict[str, Any]:
    import torch

    from bridge_ext.stack import describe_stack, have_transformer_engine

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "stack": describe_stack(),
                           "transformer_engine": have_transformer_engine(),
                           "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = round(10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
    return out


class _StepClock:
    """Megatron Bridge callback: wall time of each iteration (synchronized), CUDA-event time of each
    ``optimizer.step()`` and of each Newton-Schulz call inside it (megatron-core's ``newton_schulz_tp``)."""

    def __init__(self, *, cuda: bool = True):
        self.cuda = cuda
        self.steps: list[float] = []
        self.optimizer_ms: list[float] = []
        self.ns_ms: list[float] = []
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0

    def install_ns_timer(self) -> bool:
        import torch

        try:
            from megatron.core.optimizer import muon as core_muon
        except ImportError:
            return False
        original = getattr(core_muon, "newton_schulz_tp", None)
        if original is None or not self.cuda:
            return False

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out

        core_muon.newton_schulz_tp = timed
        return True

    def callback(self) -> Any:
        import torch
        from megatron.bridge.training.callbacks import Callback

        clock = self

        class StepClock(Callback):
            def on_train_start(self, context: Any) -> None:
                if not clock.cuda:
                    return
                optimizer = context.optimizer
                original = optimizer.step

                def timed_step(*args: Any, **kwargs: Any) -> Any:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = original(*args, **kwargs)
                    end.record()
                    end.synchronize()
                    clock.optimizer_ms.append(start.elapsed_time(end))
                    clock.ns_ms.append(sum(s.elapsed_time(e) for s, e in clock._events))
                    clock._events.clear()
                    return out

                optimizer.step = timed_step

            def on_train_step_start(self, context: Any) -> None:
                if clock.cuda:
                    torch.cuda.synchronize()
                clock._t0 = time.perf_counter()

            def on_train_step_end(self, context: Any) -> None:
                if clock.cuda:
                    torch.cuda.synchronize()
                clock.steps.append(time.perf_counter() - clock._t0)

        return StepClock()


def worker_train(recipe_name: str, *, iters: int, data: str, work: Path, timed: bool,
                 device: str = "gpu", precision: str | None = None) -> dict[str, Any]:
    """Train one recipe at layout h200x1 through the CLI's own pipeline; losses (and timings). ``device="cpu"``
    runs the same code in CPU mode (fp32), only to try this script without a GPU."""
    import statistics

    import torch

    from bridge_ext.build import build_config
    from bridge_ext.training import loss_recorder, prepare, read_losses, run_pretrain
    from recipes import get_recipe

    _single_process_env()
    recipe = get_recipe(recipe_name)
    work.mkdir(parents=True, exist_ok=True)
    cfg = build_config(recipe, layout=LAYOUT, values={
        "train.train_iters": iters, "logger.log_interval": 1, "checkpoint.save": None, "checkpoint.load": None,
        "logger.tensorboard_dir": None, "scheduler.lr_warmup_iters": max(1, min(5, iters // 5)),
        "train.eval_iters": 0, **({"mixed_precision": precision} if precision else {})})
    prepared = prepare(recipe, cfg, device=device, data=data, telemetry=False)
    cuda = not prepared.use_cpu
    cfg.dataset.path_to_cache = str(work / "index-cache")  # runs side by side: no shared index files
    losses_path = work / "losses.jsonl"
    losses_path.unlink(missing_ok=True)
    clock = _StepClock(cuda=cuda)
    callbacks = [loss_recorder(losses_path)]
    if timed:
        clock.install_ns_timer()
        callbacks.append(clock.callback())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run_pretrain(cfg, prepared, callbacks=callbacks)
    wall = time.perf_counter() - start
    losses = read_losses(losses_path)
    out: dict[str, Any] = {"recipe": recipe_name, "layout": LAYOUT, "iters": iters, "wall_s": round(wall, 1),
                           "losses": [losses[i] for i in sorted(losses)],
                           "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
                           "transformer_engine": not getattr(cfg.model, "transformer_impl", "") == "local"}
    if timed and clock.steps:
        from megatron.bridge.training.utils.flop_utils import num_floating_point_operations

        skip = min(3, len(clock.steps) - 1)  # warm-up: allocator, cuBLAS heuristics
        step_s = statistics.median(clock.steps[skip:])
        flops = num_floating_point_operations(cfg, cfg.train.global_batch_size)
        opt_ms = statistics.median(clock.optimizer_ms[skip:]) if clock.optimizer_ms[skip:] else None
        ns_ms = statistics.median(clock.ns_ms[skip:]) if clock.ns_ms[skip:] else None
        out.update(step_ms=round(step_s * 1e3, 1), model_tflops=round(flops / step_s / 1e12, 1),
                   flops_per_step=flops, optimizer_step_ms=None if opt_ms is None else round(opt_ms, 2),
                   newton_schulz_ms=None if ns_ms is None else round(ns_ms, 2),
                   newton_schulz_share=None if not ns_ms else round(ns_ms / (step_s * 1e3), 4),
                   tokens_per_step=cfg.train.global_batch_size * cfg.model.seq_length)
    return out


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------

def _spawn(args: list[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _worker(kind: str, out_json: Path, log: Path, *extra: str) -> subprocess.Popen:
    return _spawn([str(Path(__file__)), "--worker", kind, "--result", str(out_json), *extra], log=log)


def _collect(proc: subprocess.Popen, out_json: Path, log: Path, *, timeout: float) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "log_tail": _tail(log)}
    if proc.returncode == 0 and out_json.exists():
        return {"ok": True, **json.loads(out_json.read_text())}
    return {"ok": False, "error": f"exit {proc.returncode}", "log_tail": _tail(log)}


def _tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def compare_curve(losses: list[float], reference: list[float], *, mean_tol: float = CURVE_MEAN_ABS_TOL,
                  tail_tol: float = CURVE_TAIL_REL_TOL) -> dict[str, Any]:
    """Mean absolute difference and last-10 relative difference of two loss curves (the shorter length)."""
    n = min(len(losses), len(reference))
    if n == 0:
        return {"match": False, "why": "no losses"}
    mean_abs = sum(abs(a - b) for a, b in zip(losses[:n], reference[:n])) / n
    tail = min(10, n)
    ours, ref = sum(losses[n - tail:n]) / tail, sum(reference[n - tail:n]) / tail
    tail_rel = abs(ours - ref) / abs(ref)
    return {"match": mean_abs <= mean_tol and tail_rel <= tail_tol,
            "mean_abs_diff": round(mean_abs, 4), "tail_rel_diff": round(tail_rel, 4)}


def run_checks(out: Path, *, iters: int, steps: int, only: set[str], work: Path, te: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "te": te}
    mean_tol, tail_tol = (TE_CURVE_MEAN_ABS_TOL, TE_CURVE_TAIL_REL_TOL) if te else (CURVE_MEAN_ABS_TOL,
                                                                                   CURVE_TAIL_REL_TOL)
    t0 = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {text}", flush=True)

    def save() -> None:  # after every step: a run stopped by its time limit keeps what it measured
        results["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        (out / "gpu_check.md").write_text(markdown(results) + "\n")

    if "env" in only:
        say("env: GPU, stack, bf16 matmul")
        results["env"] = _collect(_worker("env", work / "env.json", work / "env.log"), work / "env.json",
                                  work / "env.log", timeout=120)
        say(f"env: {json.dumps({k: v for k, v in results['env'].items() if k != 'log_tail'})}")
        save()
    if "proxies" in only:
        from bridge_ext.data import prepare_text_corpus

        prepare_text_corpus(quiet=True)  # once, before the runs side by side read it
        say(f"proxies: {len(PROXIES) * len(PRESETS)} runs of {iters} iterations side by side")
        procs = {}
        for model in PROXIES:
            for preset in PRESETS:
                name = f"{model}_{preset}"
                procs[name] = _worker("train", work / f"{name}.json", work / f"{name}.log", "--recipe", name,
                                      "--iters", str(iters), "--data", "text", "--work", str(work / name))
        reference = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else None
        runs: dict[str, Any] = {}
        started = time.perf_counter()
        for name, proc in procs.items():
            runs[name] = _collect(proc, work / f"{name}.json", work / f"{name}.log",
                                  timeout=max(10.0, 240 - (time.perf_counter() - started)))
            if runs[name]["ok"] and reference and name in reference:
                runs[name]["reference"] = compare_curve(runs[name]["losses"], reference[name]["losses"],
                                                        mean_tol=mean_tol, tail_tol=tail_tol)
            say(f"proxies: {name}: " + (f"loss {runs[name]['losses'][0]:.3f} -> {runs[name]['losses'][-1]:.3f}, "
                                        f"{runs[name]['wall_s']} s" if runs[name]["ok"] else runs[name]["error"])
                + (f", vs reference {runs[name]['reference']}" if "reference" in runs[name] else ""))
        results["proxies"] = runs
        if reference is None and not te:  # the stored reference is the local spec's
            curves = {name: {"losses": r["losses"], "iters": r["iters"], "layout": LAYOUT,
                             "gpu": results.get("env", {}).get("gpu"),
                             "stack": results.get("env", {}).get("stack")}
                      for name, r in runs.items() if r["ok"]}
            (out / "proxy_curves.json").write_text(json.dumps(curves, indent=1) + "\n")
            results["reference_written"] = str(out / "proxy_curves.json")
            say(f"proxies: no reference curves yet; wrote {out / 'proxy_curves.json'} "
                f"(commit it as {REFERENCE.relative_to(REPO)})")
        save()
    if "qwen3_0p6b" in only:
        dense = {}
        for preset in PRESETS:  # one after the other: the timings must not share the GPU
            name = f"{DENSE}_{preset}"
            say(f"qwen3_0p6b: {name}, {steps} iterations")
            dense[name] = _collect(
                _worker("train", work / f"{name}.json", work / f"{name}.log", "--recipe", name, "--iters", str(steps),
                        "--data", "mock", "--work", str(work / name), "--timed"),
                work / f"{name}.json", work / f"{name}.log", timeout=200)
            r = dense[name]
            say(f"qwen3_0p6b: {name}: " + (
                f"step {r.get('step_ms')} ms, {r.get('model_tflops')} TFLOP/s, optimizer {r.get('optimizer_step_ms')} "
                f"ms, NS {r.get('newton_schulz_ms')} ms, peak {r['peak_allocated_bytes'] / 2**30:.1f} GiB"
                if r["ok"] else r["error"]))
            results["qwen3_0p6b"] = dense
            save()
    if "rehearse" in only:
        name = f"{DENSE}_muon"
        say(f"rehearse: nemo llm rehearse --recipe {name} --layout {LAYOUT} --device cuda")
        log = work / "rehearse.log"
        proc = _spawn(["-m", "bridge_ext.commands", "llm", "rehearse", "--recipe", name, "--layout", LAYOUT,
                       "--device", "cuda", "--json"], log=log, env={"MASTER_PORT": str(_free_port())})
        try:
            proc.wait(timeout=180)
            text = log.read_text(errors="replace")
            start = text.find("[")
            rehearsal = json.loads(text[start:text.rindex("]") + 1])[0] if proc.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError) as exc:
            proc.kill()
            rehearsal, text = None, f"{type(exc).__name__}: {exc}"
        plan = subprocess.run([sys.executable, "-m", "bridge_ext.commands", "llm", "plan", "--recipe", name,
                               "--layout", LAYOUT, "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
        entry: dict[str, Any] = {"ok": rehearsal is not None}
        if rehearsal is None:
            entry["log_tail"] = _tail(log)
        else:
            entry.update(cuda_max_allocated=rehearsal.get("cuda_max_allocated"), measured=rehearsal.get("measured"),
                         planned=rehearsal.get("planned"), micro_batch=rehearsal.get("micro_batch"),
                         notes=rehearsal.get("notes"))
        try:
            entry["plan"] = json.loads(plan.stdout)
        except ValueError:
            entry["plan_error"] = (plan.stderr or plan.stdout)[-500:]
        real = results.get("qwen3_0p6b", {}).get(name, {})
        if entry["ok"] and real.get("ok") and entry.get("cuda_max_allocated"):
            entry["real_run_peak_bytes"] = real["peak_allocated_bytes"]
            entry["rehearsal_over_real"] = round(entry["cuda_max_allocated"] / real["peak_allocated_bytes"], 3)
        say(f"rehearse: " + (f"rehearsal peak {entry.get('cuda_max_allocated', 0) / 2**30:.2f} GiB, real run "
                             f"{real.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB, ratio "
                             f"{entry.get('rehearsal_over_real')}" if entry["ok"] else "failed"))
        results["rehearse"] = entry
    if te:
        run_te_steps(results, only=only, iters=iters, work=work, say=say)
    save()
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return results


def run_te_steps(results: dict[str, Any], *, only: set[str], iters: int, work: Path, say: Any) -> None:
    """--te only: the TE probe, the fp8 rows, QK-clip on TE attention and the round trip."""
    if "te_probe" in only:
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "te" / "probe.py")], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("probe: ")), None)
        results["te_probe"] = {"ok": proc.returncode == 0, **(json.loads(line[7:]) if line else {}),
                               **({} if proc.returncode == 0 else {"log_tail": (proc.stdout + proc.stderr)[-3000:]})}
        say(f"te_probe: {'ok' if proc.returncode == 0 else 'failed'}")
    if "fp8" in only:
        reference = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
        runs: dict[str, Any] = {}
        for step in [s for s in plan_steps(iters=iters, steps=1, te=True) if s["step"] == "fp8"]:
            name = f"{step['recipe']}@{step['precision'].replace('bf16_with_', '').replace('_mixed', '')}"
            say(f"fp8: {name}")
            runs[name] = _collect(
                _worker("train", work / f"{name}.json", work / f"{name}.log", "--recipe", step["recipe"], "--iters",
                        str(iters), "--data", "text", "--work", str(work / name), "--precision", step["precision"]),
                work / f"{name}.json", work / f"{name}.log", timeout=240)
            if runs[name]["ok"] and step["recipe"] in reference:
                runs[name]["reference"] = compare_curve(runs[name]["losses"], reference[step["recipe"]]["losses"],
                                                        mean_tol=FP8_CURVE_MEAN_ABS_TOL, tail_tol=FP8_CURVE_TAIL_REL_TOL)
        results["fp8"] = runs
    run_te_workers(results, only=only, work=work, say=say)


def run_te_workers(results: dict[str, Any], *, only: set[str], work: Path, say: Any, device: str = "cuda",
                   recipes: set[str] | None = None) -> None:
    """QK-clip on the attention's own max logit and the import -> step -> export round trip (bench/te/workers.py),
    side by side (the proxies are tiny). ``device="cpu"``: the CPU rehearsal, local spec only (round trip: local vs
    local, which rehearses every part but the TE spec itself)."""
    workers = REPO / "bench" / "te" / "workers.py"
    spec = "te" if device == "cuda" else "local"
    procs: dict[tuple[str, str], tuple[subprocess.Popen, Path, Path]] = {}
    for step in plan_steps(iters=1, steps=1, te=True):
        part = step["step"]
        if part not in ("qk_clip", "round_trip") or part not in only or (recipes and step["recipe"] not in recipes):
            continue
        name = f"{part}_{step['recipe']}"
        out_json, log = work / f"{name}.json", work / f"{name}.log"
        out_json.unlink(missing_ok=True)
        if part == "qk_clip":
            args = ["qk-clip", "--spec", spec, "--iters", str(step["iters"])]
        else:
            args = ["round-trip", "--specs", f"{spec},local", "--work", str(work / name)]
        say(f"{part}: {step['recipe']} ({step.get('attention', 'import -> step -> export')}, {device}, {spec} spec)")
        procs[(part, step["recipe"])] = (
            _spawn([str(workers), *args, "--recipe", step["recipe"], "--device", device, "--result", str(out_json)],
                   log=log), out_json, log)
    started = time.perf_counter()
    for (part, recipe), (proc, out_json, log) in procs.items():
        try:
            proc.wait(timeout=max(10.0, 420 - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
        if out_json.exists():  # the worker writes its result, passed or not
            entry = json.loads(out_json.read_text())
            if not entry.get("ok"):
                entry["log_tail"] = _tail(log)
        else:
            entry = {"ok": False, "error": "timed out" if proc.returncode is None or proc.returncode < 0
                     else f"exit {proc.returncode}", "log_tail": _tail(log)}
        results.setdefault(part, {})[recipe] = entry
        if part == "qk_clip":
            say(f"qk_clip: {recipe}: " + (f"max logit after the clip {entry.get('after_clip_max')} (tau "
                                          f"{entry.get('tau')}), measured vs recomputed "
                                          f"{entry.get('measured_vs_recomputed_rel')}" if "after_clip_max" in entry
                                          else entry.get("error", "")) + ("" if entry["ok"] else
                                                                          f"; FAILED {entry.get('problems', '')}"))
        else:
            say(f"round_trip: {recipe}: " + (f"{entry.get('compared')}: max {entry.get('max_rel_of_update')} of the "
                                             f"step's update ({entry.get('worst_tensor')})" if "compared" in entry
                                             else entry.get("error", "")) + ("" if entry["ok"] else
                                                                             f"; FAILED {entry.get('problems', '')}"))


def markdown(results: dict[str, Any]) -> str:
    """The measured table (docs/launch.md)."""
    env = results.get("env", {})
    if results.get("rehearsal"):
        lines = [f"CPU rehearsal of {results.get('started')} ({results['rehearsal']}): "
                 f"{results.get('seconds')} s in all.", ""]
    else:
        lines = [f"GPU check of {results.get('started')}: {env.get('gpu', '?')} ({env.get('memory_gib', '?')} GiB), "
                 f"PyTorch {env.get('torch', '?')} CUDA {env.get('cuda', '?')}, {env.get('stack', '?')}; "
                 f"Transformer Engine: {'yes' if env.get('transformer_engine') else 'absent (local spec)'}; "
                 f"bf16 8192^3 matmul {env.get('bf16_matmul_tflops', '?')} TFLOP/s; {results.get('seconds')} s in all.",
                 ""]
    proxies = results.get("proxies", {})
    if proxies:
        lines += ["| proxy run (h200x1, bf16) | iterations | first loss | last loss | wall s | vs reference |",
                  "|---|---|---|---|---|---|"]
        for name, r in proxies.items():
            if r.get("ok"):
                ref = r.get("reference")
                ref_text = ("match" if ref["match"] else "DIFFERS") + \
                    f" (mean abs {ref['mean_abs_diff']}, tail {ref['tail_rel_diff']:.1%})" if ref else "written now"
                lines.append(f"| {name} | {r['iters']} | {r['losses'][0]:.3f} | {r['losses'][-1]:.3f} | {r['wall_s']} | "
                             f"{ref_text} |")
            else:
                lines.append(f"| {name} | failed: {r.get('error')} | | | | |")
        lines.append("")
    dense = results.get("qwen3_0p6b", {})
    if dense:
        lines += ["| Qwen3-0.6B (h200x1: 16 x 4096 tokens) | step ms | model TFLOP/s | optimizer step ms | "
                  "Newton-Schulz ms (share of step) | peak GiB |", "|---|---|---|---|---|---|"]
        for name, r in dense.items():
            if r.get("ok"):
                share = f" ({r['newton_schulz_share']:.1%})" if r.get("newton_schulz_share") else ""
                lines.append(f"| {name} | {r['step_ms']} | {r['model_tflops']} | {r['optimizer_step_ms']} | "
                             f"{r.get('newton_schulz_ms') or '-'}{share} | {r['peak_allocated_bytes'] / 2**30:.2f} |")
            else:
                lines.append(f"| {name} | failed: {r.get('error')} | | | | |")
        names = list(dense)
        if len(names) == 2 and all(dense[n].get("ok") for n in names):
            a, b = dense[names[0]], dense[names[1]]
            lines.append(f"\nMuon / AdamW: step time {a['step_ms'] / b['step_ms']:.3f}, optimizer step "
                         f"{a['optimizer_step_ms'] / b['optimizer_step_ms']:.2f}x.")
        lines.append("")
    clip = results.get("qk_clip", {})
    if clip:
        lines += ["| QK-clip (tau, forced heads) | attention | spec | max logit step 1 (before clip) | after the last "
                  "clip / tau | measured vs recomputed | ok |", "|---|---|---|---|---|---|---|"]
        for name, r in clip.items():
            first = max(r["telemetry_max_per_step_and_layer"][0]) if r.get("telemetry_max_per_step_and_layer") else "-"
            lines.append(f"| {name} (tau {r.get('tau')}) | {r.get('attention', '?')} | {r.get('spec', '?')} | "
                         f"{first} | {r.get('after_over_tau', '-')} | {r.get('measured_vs_recomputed_rel', '-')} | "
                         f"{'yes' if r.get('ok') else 'NO: ' + str(r.get('problems') or r.get('error'))} |")
        lines.append("")
    trip = results.get("round_trip", {})
    if trip:
        lines += ["| round trip (fp32, 1 step) | compared | tensors moved | max of the update (tensor) | median | ok |",
                  "|---|---|---|---|---|---|"]
        for name, r in trip.items():
            lines.append(f"| {name} | {r.get('compared', '-')} | {r.get('moved', '-')}/{r.get('tensors', '-')} | "
                         f"{r.get('max_rel_of_update', '-')} ({r.get('worst_tensor', '-')}) | "
                         f"{r.get('median_rel_of_update', '-')} | "
                         f"{'yes' if r.get('ok') else 'NO: ' + str(r.get('problems') or r.get('error'))} |")
        lines.append("")
    reh = results.get("rehearse")
    if reh:
        if reh.get("ok"):
            lines.append(f"`nemo llm rehearse --device cuda` (qwen3_0p6b_muon, h200x1): max allocated "
                         f"{reh['cuda_max_allocated'] / 2**30:.2f} GiB; the real run's "
                         f"{reh.get('real_run_peak_bytes', 0) / 2**30:.2f} GiB; rehearsal / real "
                         f"{reh.get('rehearsal_over_real')}.")
        else:
            lines.append("`nemo llm rehearse --device cuda`: failed (gpu_check.json has the log tail).")
    return "\n".join(lines)


def _te_spec_problems(step: dict[str, Any], cfg: Any) -> tuple[list[str], str]:
    """--te: the config a GPU with TE would train (checked on CPU without importing transformer_engine)."""
    import functools

    problems: list[str] = []
    model = cfg.model
    impl = getattr(model, "transformer_impl", "transformer_engine")
    if impl != "transformer_engine":
        problems.append(f"{step['recipe']}: transformer_impl={impl!r}, not the TE spec")
    spec = getattr(model, "transformer_layer_spec", None)
    if isinstance(spec, functools.partial) and spec.keywords.get("use_transformer_engine") is False:
        problems.append(f"{step['recipe']}: its layer spec is built without Transformer Engine")
    note = "TE spec"
    if step["step"] == "fp8":
        precision = getattr(cfg, "mixed_precision", None)
        if isinstance(precision, str) and precision != step["precision"]:
            problems.append(f"{step['recipe']}: mixed_precision {precision!r} != {step['precision']!r}")
    if step["step"] == "qk_clip":
        if not getattr(model, "qk_clip", False):
            problems.append(f"{step['recipe']}: qk_clip is off")
        mla = bool(getattr(model, "multi_latent_attention", False))
        if mla != (step["attention"] == "MLA"):
            problems.append(f"{step['recipe']}: attention is {'MLA' if mla else 'GQA'}, expected {step['attention']}")
        note += f", {step['attention']}, qk_clip tau {getattr(model, 'qk_clip_threshold', '?')}"
    if step["step"] == "round_trip":
        from recipes import get_recipe

        config_dir = Path(get_recipe(step["recipe"]).model.config_dir)
        if not (config_dir / "config.json").exists():
            problems.append(f"{step['recipe']}: no HF config at {config_dir}")
        note += f", HF config {config_dir.name}"
    return problems, note


def _mixed_precision_names() -> set[str]:
    """The mixed-precision recipes Megatron Bridge registers, read from its source (importing it imports TE)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        return set()
    source = Path(list(spec.submodule_search_locations)[0]) / "training" / "mixed_precision.py"
    return set(re.findall(r"^def (\w+)\(\) -> \"?MixedPrecisionConfig", source.read_text(), flags=re.M))


def dry_run(*, iters: int, steps: int, te: bool = False) -> int:
    """Print each step and check every recipe and layout it names (built and validated as the run builds them).
    ``te``: also that each config is the TE spec a GPU with TE trains, that the fp8 recipes exist, that QK-clip is
    on for MLA and GQA, and that the TE carrier (bench/te) is there; transformer_engine itself is never imported."""
    from bridge_ext.build import build_config, validate_for_layout
    from recipes import get_recipe

    problems = []
    if te:
        names = _mixed_precision_names()
        for precision in FP8_PRECISIONS:
            if precision not in names:
                problems.append(f"megatron-bridge has no mixed-precision recipe {precision}")
        for path in ("bench/te/te.py", "bench/te/probe.py", "bench/te/workers.py"):
            if not (REPO / path).exists():
                problems.append(f"{path} is missing")
    for step in plan_steps(iters=iters, steps=steps, te=te):
        line = f"{step['step']:<11} {step.get('recipe', ''):<24} {step.get('layout', ''):<7} {step['what']}"
        if "recipe" in step:
            recipe = get_recipe(step["recipe"])
            layout = recipe.layout(step["layout"])
            values: dict[str, Any] = {"train.train_iters": step.get("iters", 1)}
            if "precision" in step:
                values["mixed_precision"] = step["precision"]
            values.update(step_values(step))
            cfg = build_config(recipe, layout=layout.cluster, values=values)
            checked = validate_for_layout(cfg, gpus=layout.gpus)
            if "precision" not in step and (checked.mixed_precision != "bf16_mixed" or not checked.optimizer.bf16):
                problems.append(f"{step['recipe']} at {layout.cluster} is not bf16")
            extra = ""
            if te:
                found, note = _te_spec_problems(step, checked)
                problems += found
                extra = f", {note}"
            precision = "bf16" if "precision" not in step else step["precision"].replace("bf16_with_", "")
            line += (f"  [ok: {layout.gpus} GPU, {checked.train.global_batch_size} x {checked.model.seq_length}, "
                     f"{precision}{extra}]")
        print(line, flush=True)
    if not (REPO / "bench" / "gpu_check.sh").exists():
        problems.append("bench/gpu_check.sh is missing")
    print(f"reference curves: {REFERENCE.relative_to(REPO)} "
          f"({'present' if REFERENCE.exists() else 'absent: the first GPU run writes them'})")
    if te:
        if "transformer_engine" in sys.modules:
            problems.append("the dry run imported transformer_engine")
        print("transformer_engine: not imported (the TE configs are checked as config objects)")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def rehearse_te_workers(out: Path, *, only: set[str], work: Path | None = None,
                        recipes: set[str] | None = None) -> int:
    """``--te --rehearse``: the QK-clip and round-trip workers on CPU with the local spec; gpu_check.json/md in
    ``out`` as a GPU run writes them. Exit 1 when a check fails."""
    only = only & {"qk_clip", "round_trip"} or {"qk_clip", "round_trip"}
    out.mkdir(parents=True, exist_ok=True)
    work = work or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "te": False,
                               "rehearsal": "cpu, local spec"}

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {text}", flush=True)

    run_te_workers(results, only=only, work=work, say=say, device="cpu", recipes=recipes)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(results) + "\n")
    failed = [f"{part}:{name}" for part in ("qk_clip", "round_trip") for name, r in results.get(part, {}).items()
              if not r.get("ok")]
    if failed:
        print(f"gpu check rehearsal: not passed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


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
