"""The two --te checks of bench/gpu_check.py that need more than a training run: QK-clip on the attention's own
max-logit measurement, and the HF import -> one step -> export round trip, TE spec vs local spec.

Device-agnostic: ``--spec te|local`` and ``--device cuda|cpu``. On a GPU with Transformer Engine
``bench/gpu_check.sh --te`` runs them on the TE spec (and the round trip on both); on any machine they run on CPU
with the local spec as a rehearsal (tests/test_gpu_check.py). Nothing here imports ``transformer_engine``; with
``--spec local`` the model is checked to hold no TE module, with ``--spec te`` to hold some.

    python bench/te/workers.py qk-clip --recipe kimi_k2_proxy_muon --spec te --device cuda --result R.json
    python bench/te/workers.py round-trip --recipe qwen3_proxy_muon --device cuda --specs te,local --work W \
        --result R.json

**qk-clip**: the recipe trains ``--iters`` steps (mock data, layout h200x1: 8 x 128 tokens, 2 micro-batches) with
QK-clip on at tau (gpu_tier.plan.QK_CLIP_TAU) and the max-logit telemetry every step. The initial weights of a few heads
are scaled up (a pre-wrap hook, before the optimizer copies them) so that their logits start far above tau: the
proxies' own logits start near 0.1, which no clip would ever touch in a few steps. After the last step (optimizer
step, then the clip) the same step's micro-batches go through the model again: the max logit per head as the
attention measures it (TE: the fused kernel's ``return_max_logit``; local GQA: our hook; local MLA: CPU mode's SDPA
attention) must be <= tau * (1 + QK_CLIP_SLACK), and equal to the max of ``q . k * softmax_scale`` recomputed from
the query and key the attention received (KERNEL_MAX_REL_TOL). GQA runs the Qwen3 proxy with QK-norm off: with
QK-norm, scaling W_q / W_k is undone by the norm and no weight-level clip can bound the logit (docs/muon.md).

**round-trip**: a random HF directory of the recipe's shipped config -> ``nemo llm import`` -> one training step per
spec from that checkpoint on the same mock batches -> ``nemo llm export`` of each -> per tensor
``||A - B|| / ||B - imported||`` <= gpu_tier.plan.ROUND_TRIP_REL_TOL, B the local spec's export (the step's own update as
the yardstick). In fp32 (TF32 off): a bf16 export rounds every weight to 8 bits, and one bf16 ulp of a weight is about
half of one step's per-element update, so a bf16 comparison would measure rounding flips, not the update.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

from gpu_tier.plan import LAYOUT, QK_CLIP_ITERS, QK_CLIP_RECIPES, ROUND_TRIP_REL_TOL, step_values  # noqa: E402
from gpu_tier.worker import single_process_env  # noqa: E402

# The last step runs at lr 0, so its weights change by the clip alone and a clipped head's max logit on the same batch
# is tau exactly, but for (a) the clips of earlier layers, which change a later layer's input (CPU, fp32: the last
# layer's clipped heads went from tau to 0.943 and 0.994 tau in GQA, 0.9997 tau in MLA: down there, but it can go
# either way), and (b) on a GPU, bf16: q and k rounded to 8 bits (2^-8 relative each, ~0.8 % on a logit) and the
# clipped weights stored in bf16 (2^-9 each). 5 % covers both with room; a clip that never acts leaves the forced
# heads at 40-120 (8-25 tau), one that skips only the last step at 1.07-1.16 tau (their values before it, CPU).
QK_CLIP_SLACK = 0.05
# The attention's own max logit vs the max of q . k * scale recomputed in fp32 from the q and k it received: bf16
# inputs are the same for both, the kernel accumulates in fp32 in another order (CPU: equal, our hook computes both).
KERNEL_MAX_REL_TOL = 1e-2
# Heads whose initial query weights are scaled: (layer, head) -> factor. Layer -1 is the last.
FORCE = {(0, 0): 400.0, (-1, 1): 1000.0, (-1, 2): 250.0}


def _problem(text: str) -> None:
    print(f"error: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- building
def _build(recipe_name: str, *, spec: str, device: str, values: dict[str, Any], fp32: bool = False,
           telemetry: bool = True) -> tuple:
    """The recipe's config at layout h200x1 on ``spec`` and ``device``, prepared as a run prepares it."""
    import torch

    from bridge_ext.build import build_config
    from bridge_ext.training import prepare
    from recipes import get_recipe

    if spec == "te" and device != "cuda":
        raise SystemExit("error: --spec te needs --device cuda (Transformer Engine has no CPU path)")
    single_process_env()
    recipe = get_recipe(recipe_name)
    cfg = build_config(recipe, layout=LAYOUT, values={
        "logger.log_interval": 1, "checkpoint.load": None, "logger.tensorboard_dir": None, "train.eval_iters": 0,
        **values})
    if fp32:
        cfg.mixed_precision = None
        for obj in (cfg.model, cfg.optimizer):
            for name, value in (("bf16", False), ("fp16", False), ("params_dtype", torch.float32)):
                if hasattr(obj, name):
                    setattr(obj, name, value)
        if hasattr(cfg.model, "pipeline_dtype"):
            cfg.model.pipeline_dtype = torch.float32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if spec == "te":
        from bridge_ext.stack import have_transformer_engine

        if not have_transformer_engine():
            raise SystemExit("error: --spec te but transformer_engine is not importable (bench/te/te.py install)")
    elif device == "cuda":  # the local spec on a GPU that has TE: as a GPU without TE runs (bridge_ext.without_te)
        from bridge_ext import patches
        from bridge_ext.without_te import configure_without_te

        configure_without_te(cfg)
        patches.apply("without-te")
    prepared = prepare(recipe, cfg, device="gpu" if device == "cuda" else "cpu", data="mock", quiet=True,
                       telemetry=telemetry)
    return recipe, cfg, prepared


def _te_modules(model: Any) -> int:
    """How many modules of the model are Transformer Engine's (or megatron-core's TE wrappers)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return sum(type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))
               for chunk in chunks for m in chunk.modules())


def _check_spec(model: Any, spec: str, out: dict[str, Any]) -> None:
    out["te_modules"] = n = _te_modules(model)
    if (spec == "te") != (n > 0):
        out.setdefault("problems", []).append(f"--spec {spec} but the model holds {n} Transformer Engine modules")


def _inner(chunk: Any) -> Any:
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


# ------------------------------------------------------------------------------------------------- qk-clip
def _force_heads(chunks: list[Any]) -> list[Any]:
    """Pre-wrap hook: scale the query rows of the FORCE heads (logits scale by the factor)."""
    import torch

    layers = _inner(chunks[0]).decoder.layers
    with torch.no_grad():
        for (layer, head), factor in FORCE.items():
            attention = layers[layer].self_attention
            config = attention.config
            heads = config.num_attention_heads
            if hasattr(attention, "linear_q_up_proj"):  # MLA: [heads * (nope + rope), q_lora_rank]
                attention.linear_q_up_proj.weight.view(heads, -1, attention.linear_q_up_proj.weight.shape[-1])[head] \
                    .mul_(factor)
            else:  # GQA: linear_qkv is [groups * (heads/groups + 2) * d, hidden], per group q rows, then k, then v
                groups, d = config.num_query_groups, config.kv_channels
                weight = attention.linear_qkv.weight.view(groups, (heads // groups + 2) * d, -1)
                per = heads // groups
                weight[head // per, (head % per) * d:(head % per + 1) * d].mul_(factor)
    return chunks


class _AfterClip:
    """Callback: keeps the last step's micro-batches; after that step (optimizer step and clip) puts them through
    the model again and reads each attention's max logit per head, beside the max recomputed from its q and k."""

    def __init__(self, iters: int):
        self.iters = iters
        self.batches: list[tuple[tuple, dict]] = []
        self.out: dict[str, Any] = {}
        self._grab = None
        self._steps = 0

    def on_train_start(self, context: Any) -> None:
        def grab(module: Any, args: tuple, kwargs: dict) -> None:
            self.batches.append((args, dict(kwargs)))

        self._grab = context.model[0].register_forward_pre_hook(grab, with_kwargs=True)

    def on_train_step_start(self, context: Any) -> None:
        self.batches = []

    def on_train_step_end(self, context: Any) -> None:
        self._steps += 1
        if self._steps < self.iters:
            return
        import torch

        from bridge_ext.muon.attention_logits import attentions
        from bridge_ext.without_te.sdpa_attention import max_logits

        self._grab.remove()
        model = context.model
        cores = [a.core_attention for a in attentions(model)]
        reference: dict[int, Any] = {}

        def recompute(index: int):
            def hook(module: Any, args: tuple, kwargs: dict) -> None:
                query = args[0] if args else kwargs["query"]
                key = args[1] if len(args) > 1 else kwargs["key"]
                if query.dim() != 4:  # packed (thd) input: no reference here
                    return
                scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(query.shape[-1])
                value = max_logits(query, key, float(scale))
                reference[index] = value if index not in reference else torch.maximum(reference[index], value)
            return hook

        hooks = [core.register_forward_pre_hook(recompute(i), with_kwargs=True) for i, core in enumerate(cores)]
        left = [getattr(core, "current_max_attn_logits", None) is not None for core in cores]
        for core in cores:  # the clip reset them; start afresh in any case
            core.current_max_attn_logits = None
        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            for args, kwargs in self.batches:
                model[0](*args, **kwargs)
        for chunk in model:
            chunk.train()
        for hook in hooks:
            hook.remove()
        measured = [getattr(core, "current_max_attn_logits", None) for core in cores]
        self.out = {
            "micro_batches": len(self.batches),
            "left_unreset_by_clip": sum(left),
            "after_clip_max_per_layer": [None if m is None else [round(float(x), 5) for x in m] for m in measured],
            "recomputed_max_per_layer": [[round(float(x), 5) for x in reference[i]] if i in reference else None
                                         for i in range(len(cores))],
        }
        for core in cores:
            core.current_max_attn_logits = None


def qk_clip(recipe_name: str, *, spec: str, device: str, iters: int) -> dict[str, Any]:
    """Train ``iters`` steps with QK-clip at tau and forced heads; the max logit after the last clip."""
    import torch

    from bridge_ext.training import run_pretrain

    attention = QK_CLIP_RECIPES[recipe_name]
    # lr decays to 0 (min_lr) before the last step (the scheduler steps after the optimizer: decay over iters - 1):
    # that step's weights change by the clip alone, so the forward after it measures the clip, not one more
    # optimizer update (which moves a proxy's max logit by up to 45 % at its peak lr)
    values = {"train.train_iters": iters, "checkpoint.save": None, "scheduler.lr_warmup_iters": 1,
              "scheduler.lr_decay_iters": iters - 1, "optimizer.min_lr": 0.0,
              **step_values({"step": "qk_clip", "attention": attention})}  # GQA: QK-norm off (module docstring)
    t0 = time.perf_counter()
    recipe, cfg, prepared = _build(recipe_name, spec=spec, device=device, values=values)
    torch.manual_seed(1234)
    cfg.model.register_pre_wrap_hook(_force_heads)
    probe = _AfterClip(iters)
    spec_seen: dict[str, Any] = {}

    class SpecCheck:
        def on_train_start(self, context: Any) -> None:
            _check_spec(context.model, spec, spec_seen)

    run_pretrain(cfg, prepared, callbacks=[SpecCheck(), probe])
    wall = time.perf_counter() - t0
    telemetry = next((c for c in prepared.callbacks if type(c).__name__ == "MuonTelemetry"), None)
    layers = cfg.model.num_layers
    logged = [[round(r.get(f"max_attention_logit/layer_{i}", float("nan")), 4) for i in range(layers)]
              for r in (telemetry.history if telemetry else [])]
    tau = float(cfg.model.qk_clip_threshold)
    out: dict[str, Any] = {"recipe": recipe_name, "attention": attention, "spec": spec, "device": device,
                           "iters": iters, "tau": tau, "slack": QK_CLIP_SLACK, "forced": {f"{l}/{h}": f for (l, h), f
                                                                                           in FORCE.items()},
                           **({"qk_layernorm": bool(cfg.model.qk_layernorm)} if attention == "GQA" else {}),
                           "transformer_engine_imported": "transformer_engine" in sys.modules,
                           "telemetry_max_per_step_and_layer": logged, "wall_s": round(wall, 1), **spec_seen,
                           **probe.out}
    problems = list(spec_seen.get("problems", []))
    after = probe.out.get("after_clip_max_per_layer") or []
    if not after or any(m is None for m in after):
        problems.append("the attention measured no max logit in the forward after the clip")
    if len(logged) != iters:
        problems.append(f"telemetry logged {len(logged)} of {iters} steps")
    elif not max(logged[0]) > tau:  # the premise: the forced heads made the first step clip
        problems.append(f"step 1's max logit {max(logged[0])} is not above tau {tau}: nothing was clipped")
    if after and all(m is not None for m in after):
        top = max(max(m) for m in after)
        out["after_clip_max"] = top
        out["after_over_tau"] = round(top / tau, 5)
        if top > tau * (1 + QK_CLIP_SLACK):
            problems.append(f"max logit after the clip {top} > tau {tau} x {1 + QK_CLIP_SLACK}")
        recomputed = probe.out.get("recomputed_max_per_layer") or []
        worst = 0.0
        for measured, ref in zip(after, recomputed):
            if ref is None:
                continue
            for a, b in zip(measured, ref):
                worst = max(worst, abs(a - b) / max(abs(b), 1e-6))
        out["measured_vs_recomputed_rel"] = round(worst, 7)
        if worst > KERNEL_MAX_REL_TOL:
            problems.append(f"the attention's max logit differs from q.k*scale recomputed by {worst:.2%} "
                            f"(> {KERNEL_MAX_REL_TOL:.0%})")
    out["ok"] = not problems
    out["problems"] = problems
    return out


# ------------------------------------------------------------------------------------------------- round trip
def _train_step(recipe_name: str, *, spec: str, device: str, ckpt: Path, save: Path) -> dict[str, Any]:
    """One step from the imported checkpoint, fp32, saved (a process of its own per spec on a GPU)."""
    from bridge_ext.training import loss_recorder, read_losses, run_pretrain

    # QK-clip off: it is the qk-clip check's; at the recipes' tau 100 it would not act on these weights (Kimi K2
    # proxy's max logit in the step: 0.61 on CPU), and in fp32 TE has no fused attention, whose kernel returns the
    # max logit. Telemetry off for the same reason (it asks TE for the max logit).
    values = {"train.train_iters": 1, "checkpoint.pretrained_checkpoint": str(ckpt), "checkpoint.save": str(save),
              "checkpoint.save_interval": 1, "scheduler.lr_warmup_iters": 0, "model.qk_clip": False,
              "model.log_max_attention_logit": False}
    t0 = time.perf_counter()
    recipe, cfg, prepared = _build(recipe_name, spec=spec, device=device, values=values, fp32=True, telemetry=False)
    cfg.checkpoint.load = None
    seen: dict[str, Any] = {}

    class SpecCheck:
        def on_train_start(self, context: Any) -> None:
            _check_spec(context.model, spec, seen)

    losses = save.parent / f"{save.name}.losses.jsonl"
    losses.unlink(missing_ok=True)
    run_pretrain(cfg, prepared, callbacks=[SpecCheck(), loss_recorder(losses)])
    return {"spec": spec, "loss": read_losses(losses).get(1), "wall_s": round(time.perf_counter() - t0, 1),
            "transformer_engine_imported": "transformer_engine" in sys.modules, **seen}


def _norm(t: Any) -> float:
    return float(t.double().norm())


def compare_exports(a_dir: Path, b_dir: Path, source_dir: Path, *, tol: float = ROUND_TRIP_REL_TOL) -> dict[str, Any]:
    """Per tensor ||A - B|| / ||B - source||: A's distance from B in units of B's one-step update."""
    from safetensors.torch import load_file

    def load(directory: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(directory.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    a, b, src = load(a_dir), load(b_dir), load(source_dir)
    problems = []
    if set(a) != set(b) or set(b) != set(src):
        problems.append(f"tensor names differ: {sorted(set(a) ^ set(b))[:5]} {sorted(set(b) ^ set(src))[:5]}")
    ratios: dict[str, float] = {}
    unmoved = []
    for name in sorted(set(a) & set(b) & set(src)):
        if a[name].shape != b[name].shape:
            problems.append(f"{name}: shape {list(a[name].shape)} vs {list(b[name].shape)}")
            continue
        update, diff = _norm(b[name].double() - src[name].double()), _norm(a[name].double() - b[name].double())
        if update == 0.0:
            unmoved.append(name)
            if diff > 0.0:
                problems.append(f"{name}: the step left it unchanged on one side, moved it by {diff:.3g} on the other")
            continue
        ratios[name] = diff / update
    worst = max(ratios, key=ratios.get) if ratios else None
    if worst is not None and ratios[worst] > tol:
        over = sorted((n for n in ratios if ratios[n] > tol), key=ratios.get, reverse=True)
        problems.append(f"{len(over)} tensors over {tol:.0%} of the step's update, worst {worst} "
                        f"{ratios[worst]:.3%}: {over[:5]}")
    moved = len(ratios)
    if moved < len(src) // 2:
        problems.append(f"the step moved only {moved} of {len(src)} tensors")
    return {"tensors": len(src), "moved": moved, "unmoved": unmoved,
            "max_rel_of_update": None if worst is None else round(ratios[worst], 7), "worst_tensor": worst,
            "median_rel_of_update": None if not ratios else round(sorted(ratios.values())[len(ratios) // 2], 7),
            "update_over_weight": None if not ratios else round(max(
                _norm(b[n].double() - src[n].double()) / max(_norm(src[n]), 1e-30) for n in ratios), 6),
            "tolerance": tol, "problems": problems, "ok": not problems}


def _run(args: list[str], log: Path, *, timeout: float, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{' '.join(args[:4])} ... exit {proc.returncode}\n{tail}")


def round_trip(recipe_name: str, *, device: str, specs: list[str], work: Path, seed: int = 5) -> dict[str, Any]:
    """HF -> import -> one step per spec -> export per spec -> compared (first spec against the last).

    On a GPU each step is a process of its own (``workers.py step``: the local spec's patches must not meet a TE
    model), import and export are ``nemo llm import`` / ``export`` processes. On CPU (the rehearsal: every spec is
    local) all of it runs in this process, through the functions those commands run (``run_import``,
    ``run_export``), to spare four interpreter starts."""
    from recipes import get_recipe
    from recipes.models import HF_CONFIGS

    in_process = device == "cpu"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "round_trip.log"
    log.write_text("")
    times: dict[str, float] = {}
    family = Path(get_recipe(recipe_name).model.config_dir).name
    shipped = Path(HF_CONFIGS) / family / "config.json"
    raw = json.loads(shipped.read_text())
    t0 = time.perf_counter()
    hf, mg = work / "hf", work / "mg"
    # a random HF directory of the shipped config (tests/hf_fixtures.py: transformers builds it)
    sys.path.insert(0, str(REPO / "tests"))
    import hf_fixtures

    hf_fixtures.write_hf_dir(hf, raw, dtype=raw.get("torch_dtype", "float32"), config_json=raw, seed=seed)
    times["hf_dir_s"] = round(time.perf_counter() - t0, 1)

    def command(*argv: str) -> None:
        if not in_process:
            _run(["-m", "bridge_ext.commands", "llm", *argv], log, timeout=300)
            return
        from contextlib import redirect_stdout

        from bridge_ext.convert import run_export, run_import

        opts = dict(zip(argv[1::2], argv[2::2]))
        with log.open("a") as f, redirect_stdout(f):
            if argv[0] == "import":
                run_import(hf=Path(opts["--hf"]), out=Path(opts["--out"]), overwrite=True)
            else:
                run_export(ckpt=Path(opts["--ckpt"]), out=Path(opts["--out"]), overwrite=True)

    t = time.perf_counter()
    command("import", "--hf", str(hf), "--out", str(mg), "--overwrite")
    times["import_s"] = round(time.perf_counter() - t, 1)
    steps: dict[str, Any] = {}
    exports: dict[str, Path] = {}
    for i, spec in enumerate(specs):
        label = f"{spec}{i}" if specs.count(spec) > 1 else spec
        run, result = work / f"run_{label}", work / f"step_{label}.json"
        t = time.perf_counter()
        if in_process:
            from bridge_ext.process_state import reset_megatron_globals
            from bridge_ext.muon import install_ns_coefficients

            reset_megatron_globals()
            try:
                steps[label] = _train_step(recipe_name, spec=spec, device=device, ckpt=mg, save=run)
            finally:
                install_ns_coefficients("quintic")
                reset_megatron_globals()
        else:
            _run([str(HERE / "workers.py"), "step", "--recipe", recipe_name, "--spec", spec, "--device", device,
                  "--ckpt", str(mg), "--save", str(run), "--result", str(result)], log, timeout=300,
                 env={"NVIDIA_TF32_OVERRIDE": "0"})
            steps[label] = json.loads(result.read_text())
        times[f"step_{label}_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        exports[label] = work / f"export_{label}"
        command("export", "--ckpt", str(run), "--out", str(exports[label]), "--overwrite")
        times[f"export_{label}_s"] = round(time.perf_counter() - t, 1)
    labels = list(exports)
    compared = compare_exports(exports[labels[0]], exports[labels[-1]], hf)
    problems = list(compared["problems"])
    for label, step in steps.items():
        problems += [f"{label}: {p}" for p in step.get("problems", [])]
    losses = {label: s.get("loss") for label, s in steps.items()}
    return {"recipe": recipe_name, "device": device, "specs": specs, "compared": f"{labels[0]} vs {labels[-1]}",
            "losses": losses, **{k: v for k, v in compared.items() if k != "problems"}, "steps": steps,
            "times": times, "wall_s": round(time.perf_counter() - t0, 1), "problems": problems, "ok": not problems}


# ------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("qk-clip", "round-trip", "step"):
        s = sub.add_parser(name)
        s.add_argument("--recipe", required=True)
        s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        s.add_argument("--result", type=Path, help="write the result JSON here (also printed as 'result: {...}')")
        if name == "qk-clip":
            s.add_argument("--spec", choices=("te", "local"), default="te")
            s.add_argument("--iters", type=int, default=QK_CLIP_ITERS)
        elif name == "round-trip":
            s.add_argument("--specs", default="te,local", help="comma-separated; the first is compared with the last")
            s.add_argument("--work", type=Path, required=True)
        else:
            s.add_argument("--spec", choices=("te", "local"), default="te")
            s.add_argument("--ckpt", type=Path, required=True)
            s.add_argument("--save", type=Path, required=True)
    args = p.parse_args(argv)
    if args.what == "qk-clip":
        result = qk_clip(args.recipe, spec=args.spec, device=args.device, iters=args.iters)
    elif args.what == "round-trip":
        result = round_trip(args.recipe, device=args.device, specs=args.specs.split(","), work=args.work)
    else:
        result = _train_step(args.recipe, spec=args.spec, device=args.device, ckpt=args.ckpt, save=args.save)
    text = json.dumps(result, default=str)
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(text)
    print("result: " + text, flush=True)
    for problem in result.get("problems", []):
        _problem(problem)
    return 0 if result.get("ok", True) and not result.get("problems") else 1


if __name__ == "__main__":
    sys.exit(main())
