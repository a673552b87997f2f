"""Conversion throughput and memory on medium synthetic models, against plain safetensors I/O.

    .venv/bin/python bench/convert.py [--sizes 1gb,8gb | --layers 6 --hidden 2048] [--dtype bfloat16]
                                      [--phases baseline,import,export,import-stream,export-stream]
                                      [--threads 2] [--workdir /tmp] [--nproc 2 --tp 2 | --pp 2]

Builds a random Qwen3 with a few wide layers per size (``1gb``: 6 layers of hidden 2048, 1.02 GB of bf16
weights; ``8gb``: 15 layers of hidden 4096, 8.08 GB) as an HF directory, then runs, each in a fresh process
so that peak RSS is its own:

* baseline:      read every shard with ``safetensors.torch.load_file`` and write it back with ``save_file``;
* import:        ``bridge_ext.convert.import_hf(stream=False)``: the model-building path (AutoBridge), no --verify;
* export:        ``bridge_ext.convert.export_hf(stream=False)`` of that checkpoint;
* import-stream: ``import_hf`` streaming (the default; :mod:`bridge_ext.convert.stream`, ``--threads``);
* export-stream: ``export_hf`` streaming, of the streamed checkpoint;
* with ``--nproc N`` and a layout (``--tp``/``--pp``): import and export again under
  ``torchrun --standalone --nproc-per-node N`` (gloo on CPU), each rank's peak RSS reported on its own line
  (the model is a dense Qwen3, so ``--ep`` does not apply).

Prints throughput (checkpoint bytes / conversion time, and / CPU time of the phase and the processes it waited
for) as a ratio to the baseline's, and peak RSS (``VmHWM``) as a ratio to the checkpoint's bytes, both raw and above the process's RSS once its libraries are imported (the fixed
cost of torch + Megatron, which does not grow with the model). With two sizes or more it also prints the
marginal rate of each phase (the slope between the smallest and the largest size: fixed costs cancel) and
its ratio to the baseline's marginal rate. Outputs are deleted as soon as the next phase no longer needs
them (the 8 GB case needs ~26 GB of disk at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_now_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and of the processes it waited for (Megatron's checkpoint writers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _peak_mb() -> float:
    """This process's peak RSS: VmHWM, which starts afresh at exec. (``ru_maxrss`` would not: Linux carries it
    over execve, so a child started by a parent that holds the generated model would report the parent's RSS.)"""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def build(out: Path, *, layers: int, hidden: int, dtype: str, shard_bytes: int) -> int:
    """Write a random Qwen3 HF directory tensor by tensor (never the whole model in memory)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests"))
    import hf_fixtures

    from bridge_ext.hf.directory import expected_hf_tensors
    from bridge_ext.hf import load_hf_config

    out.mkdir(parents=True)
    config = dict(hf_fixtures.QWEN3_TINY, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 128, num_key_value_heads=hidden // 256, head_dim=128,
                  vocab_size=32_000, torch_dtype=dtype)  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shapes = expected_hf_tensors(load_hf_config(out))
    gen = torch.Generator().manual_seed(0)
    written: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        file = out / f"part-{len(written):05d}.safetensors"
        save_file(pending, file, metadata={"format": "pt"})
        written.append((file, list(pending)))
        pending.clear()

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(getattr(torch, dtype))
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=t.dtype)
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > shard_bytes:
            flush()
            size = 0
        pending[name] = t
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, (file, keys) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        file.rename(out / final)
        weight_map.update({k: final for k in keys})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return total


def phase(name: str, hf: Path, work: Path, *, tp: int = 1, pp: int = 1, threads: int = 2) -> dict:
    """Run in a child process (one per torchrun rank with a layout): one phase, its wall time and peak RSS."""
    if name == "baseline":
        from safetensors.torch import load_file, save_file

        base = _rss_now_mb()
        cpu = _cpu_seconds()
        out = work / "baseline"
        out.mkdir()
        start = time.perf_counter()
        total = 0
        for file in sorted(hf.glob("*.safetensors")):
            tensors = load_file(file)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, out / file.name, metadata={"format": "pt"})
            del tensors
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "cpu": _cpu_seconds() - cpu, "bytes": total, "peak_mb": _peak_mb(), "base_mb": base}

    import torch  # noqa: F401  (libraries first, so base_mb is the fixed cost)

    from bridge_ext import convert
    from bridge_ext.convert.model import prepare_runtime

    prepare_runtime()
    import megatron.bridge.training.model_load_save  # noqa: F401

    base = _rss_now_mb()
    cpu = _cpu_seconds()
    suffix = "" if tp * pp == 1 else f"-tp{tp}-pp{pp}"
    stream = name.endswith("-stream")
    if stream:
        suffix += "-stream"
    quiet = dict(progress=False, console=None, stream=stream)
    if stream:
        quiet["threads"] = threads
    if name.startswith("import"):
        summary = convert.import_hf(hf, work / f"mg{suffix}", tp=tp, pp=pp, **quiet)
    else:
        summary = convert.export_hf(work / f"mg{suffix}", work / f"out{suffix}", tp=tp, pp=pp, **quiet)
    return {"seconds": summary.seconds, "cpu": _cpu_seconds() - cpu, "bytes": summary.bytes, "peak_mb": _peak_mb(),
            "base_mb": base,
            "rank": int(os.environ.get("RANK", "0"))}  # fmt: skip


SIZES = {"1gb": (6, 2048), "2.5gb": (4, 4096), "8gb": (15, 4096)}  # name -> (layers, hidden)
PHASES = ("baseline", "import", "export", "import-stream", "export-stream")
# After a phase, the outputs no later phase reads (disk: the 8 GB case).
_DONE_WITH = {"baseline": ["baseline"], "export": ["mg", "out"], "export-stream": ["mg-stream", "out-stream"]}


def _run_phase(name: str, nproc: int, hf: Path, work: Path, args: argparse.Namespace) -> list[dict]:
    launch = [sys.executable] if nproc == 1 else [str(Path(sys.executable).with_name("torchrun")), "--standalone",
                                                  f"--nproc-per-node={nproc}"]  # fmt: skip
    proc = subprocess.run(
        [*launch, __file__, "--phase", name, "--hf", str(hf), "--work", str(work), "--threads", str(args.threads)]
        + (["--tp", str(args.tp), "--pp", str(args.pp)] if nproc > 1 else []),
        capture_output=True, text=True,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != nproc:
        sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line[len("RESULT "):]) for line in lines]


def _table(results: dict, total: int) -> None:
    """Per phase: wall time and throughput, CPU time and CPU throughput (bytes per CPU second: on a machine shared
    with other jobs, wall time is what the scheduler left over), each as a ratio to the baseline; peak RSS."""
    base = results.get("baseline")
    print(f"{'phase':<22} {'time s':>8} {'GB/s':>7} {'x base':>7} {'cpu s':>7} {'GB/cpu-s':>9} {'x base':>7} "
          f"{'peak RSS GB':>12} {'x ckpt':>7} {'above libs GB':>14} {'x ckpt':>7}")  # fmt: skip
    for name, r in results.items():
        tp, cpu_tp = r["bytes"] / r["seconds"], r["bytes"] / max(r["cpu"], 1e-9)
        above = (r["peak_mb"] - r["base_mb"]) * 2**20
        peak = r["peak_mb"] * 2**20
        ratio = f"{tp / (base['bytes'] / base['seconds']):7.3f}" if base else f"{'':>7}"
        cpu_ratio = f"{cpu_tp / (base['bytes'] / max(base['cpu'], 1e-9)):7.3f}" if base else f"{'':>7}"
        print(f"{name:<22} {r['seconds']:8.2f} {tp / 1e9:7.3f} {ratio} {r['cpu']:7.2f} {cpu_tp / 1e9:9.3f} {cpu_ratio} "
              f"{peak / 1e9:12.2f} {peak / total:7.2f} {above / 1e9:14.2f} {above / total:7.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=None, help=f"comma-separated sizes among {', '.join(SIZES)}")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases among " + ", ".join(PHASES))
    parser.add_argument("--threads", type=int, default=2, help="threads of the streaming phases")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--nproc", type=int, default=1, help="also convert with this many torchrun processes")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the torchrun conversion")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the torchrun conversion")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.phase:  # child
        result = phase(args.phase, args.hf, args.work, tp=args.tp, pp=args.pp, threads=args.threads)
        print("RESULT " + json.dumps(result), flush=True)
        return

    sizes = ([(name, *SIZES[name]) for name in args.sizes.split(",")] if args.sizes
             else [(f"{args.layers}x{args.hidden}", args.layers, args.hidden)])  # fmt: skip
    phases = [p for p in args.phases.split(",") if p]
    measured: dict[str, tuple[int, dict]] = {}
    for size, layers, hidden in sizes:
        work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
        try:
            hf = work / "hf"
            total = build(hf, layers=layers, hidden=hidden, dtype=args.dtype, shard_bytes=args.shard_mb * 10**6)
            print(f"\nmodel {size}: Qwen3, {layers} layers, hidden {hidden}, {args.dtype}: {total / 1e9:.3f} GB "
                  f"in {len(list(hf.glob('*.safetensors')))} shards", flush=True)  # fmt: skip
            results = {}
            runs = [(name, 1) for name in phases]
            if args.nproc > 1:
                runs += [(name, args.nproc) for name in phases if name in ("import", "export")]
            for name, nproc in runs:
                for r in _run_phase(name, nproc, hf, work, args):
                    label = name if nproc == 1 else f"{name} tp{args.tp}pp{args.pp} rank {r['rank']}"
                    results[label] = r
                if nproc == 1:
                    for leftover in _DONE_WITH.get(name, []):
                        shutil.rmtree(work / leftover, ignore_errors=True)
            _table(results, total)
            measured[size] = (total, results)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if len(measured) > 1:
        (small, (b0, r0)), (large, (b1, r1)) = list(measured.items())[0], list(measured.items())[-1]
        print(f"\nmarginal rate between {small} and {large} (extra bytes / extra seconds):")
        for key, unit in (("seconds", "GB/s"), ("cpu", "GB/cpu-s")):
            marginal = {n: (r1[n]["bytes"] - r0[n]["bytes"]) / max(r1[n][key] - r0[n][key], 1e-9)
                        for n in r1 if n in r0}  # fmt: skip
            base = marginal.get("baseline")
            for name, rate in marginal.items():
                ratio = f"{rate / base:.3f}x baseline" if base else ""
                print(f"{name:<22} {rate / 1e9:7.3f} {unit:<8}  {ratio}")


if __name__ == "__main__":
    main()
