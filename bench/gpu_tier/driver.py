"""The GPU tier's driver: each step in a worker process of its own (so one failure leaves the others' numbers),
the results saved after every step (``gpu_check.json``, ``gpu_check.md``); ``--te``'s probe, fp8 rows and the
QK-clip and round-trip workers (bench/te/workers.py), on the GPU or rehearsed on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_tier.plan import (CURVE_MEAN_ABS_TOL, CURVE_TAIL_REL_TOL, DENSE, FP8_CURVE_MEAN_ABS_TOL,
                           FP8_CURVE_TAIL_REL_TOL, LAYOUT, PRESETS, PROXIES, REFERENCE, REPO, TE_CURVE_MEAN_ABS_TOL,
                           TE_CURVE_TAIL_REL_TOL, compare_curve, plan_steps)
from gpu_tier.report import markdown
from gpu_tier.worker import free_port

__all__ = ["rehearse_te_workers", "run_checks", "run_te_steps", "run_te_workers"]

ENTRY = REPO / "bench" / "gpu_check.py"  # the workers run as `python bench/gpu_check.py --worker KIND`


def _spawn(args: list[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _worker(kind: str, out_json: Path, log: Path, *extra: str) -> subprocess.Popen:
    return _spawn([str(ENTRY), "--worker", kind, "--result", str(out_json), *extra], log=log)


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
                       "--device", "cuda", "--json"], log=log, env={"MASTER_PORT": str(free_port())})
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
        say("rehearse: " + (f"rehearsal peak {entry.get('cuda_max_allocated', 0) / 2**30:.2f} GiB, real run "
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
