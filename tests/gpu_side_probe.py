"""What each GPU-side entry loads, with the GPU decision forced on a machine without one (tests/test_gpu_side.py).

    python tests/gpu_side_probe.py WORKDIR HF_DIR     # WORKDIR/reports.jsonl: one JSON line per entry

Every entry decides CPU or GPU by asking ``torch.cuda.is_available()``; here it answers True (set once, before
anything of ours is imported), so each entry takes its GPU path. Each entry runs in a child forked from this
process (torch and the command table imported once; a fresh Megatron state per entry) and reports the
``bridge_ext`` modules loaded when it ended, and how it ended: ``completed`` (exit 0), or ``reached the GPU``
(the first CUDA call failed: everything the entry decides before touching the device ran, model building
included), or anything else (a failure the test shows).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

# The questions a GPU path asks before its first CUDA call (ours: is_available; upstream's validation and imports:
# the device's properties), answered for one H100; any real CUDA call still fails.
_H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30,
                        multi_processor_count=132)
_REAL = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count", "current_device",
                                                     "get_device_properties", "get_device_capability",
                                                     "get_device_name")}
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda device=None: _H100
torch.cuda.get_device_capability = lambda device=None: (_H100.major, _H100.minor)
torch.cuda.get_device_name = lambda device=None: _H100.name

from bridge_ext.commands import main as nemo  # noqa: E402  (after the forced answer)
import bridge_ext.training  # noqa: E402,F401  (the GPU path's own module: what every child would import first)
import megatron.bridge.training.pretrain  # noqa: E402,F401  (upstream's modules, imported once for all children)

# The first CUDA call on a machine without a GPU or driver (torch's lazy CUDA init, NCCL, a CUDA tensor).
_NO_GPU = re.compile(r"NVIDIA driver|No CUDA GPUs|Torch not compiled with CUDA|CUDA driver|NCCL|cudaGetDevice|"
                     r"CUDA error|no CUDA-capable device")


def entries(work: Path, hf: Path) -> dict[str, list[str] | str]:
    ckpt = work / "imported"
    finetune = ["llm", "finetune", "--recipe", "kimi_k2_lora_muon", "--device", "gpu",
                f"checkpoint.pretrained_checkpoint={ckpt}"]
    return {
        "import": ["llm", "import", "--hf", str(hf), "--out", str(work / "imported-streamed")],
        "import --no-stream": ["llm", "import", "--hf", str(hf), "--out", str(work / "imported-built"), "--no-stream"],
        "pretrain --dryrun": ["llm", "pretrain", "--recipe", "kimi_k2_muon", "--dryrun", "--device", "gpu"],
        "pretrain --to-yaml": ["llm", "pretrain", "--recipe", "kimi_k2_muon", "--device", "gpu",
                               "--to-yaml", str(work / "pretrain.yaml")],
        "finetune --dryrun": [*finetune, "--dryrun"],
        "finetune --to-yaml": [*finetune, "--to-yaml", str(work / "finetune.yaml")],
        "api prepare_for_this_machine": "api",
        "every scope a GPU run applies": "scopes",
        "export": ["llm", "export", "--ckpt", str(ckpt), "--out", str(work / "exported")],
        "export --no-stream": ["llm", "export", "--ckpt", str(ckpt), "--out", str(work / "exported-built"),
                               "--no-stream"],
        "evaluate": ["llm", "evaluate", "--ckpt", str(ckpt), "--data", "mock", "--tokens", "64"],
        "generate": ["llm", "generate", "--ckpt", str(ckpt), "--prompt", "hello", "--max-new-tokens", "2"],
    }


def _api() -> int:
    from bridge_ext.api import prepare_for_this_machine, recipe_config

    prepare_for_this_machine(recipe_config("qwen3_proxy_muon"), device="gpu", data="mock")
    return 0


def _scopes() -> int:
    """A GPU recipe built and validated for its layout, then every scope a GPU run applies."""
    from bridge_ext import patches
    from bridge_ext.api import recipe_config

    recipe_config("qwen3_0p6b_muon")
    for scope in ("import", "config", "stack", "muon", "checkpointing", "conversion"):
        patches.apply(scope)
    return 0


def _run(argv: list[str] | str) -> dict[str, str]:
    try:
        rc = _api() if argv == "api" else _scopes() if argv == "scopes" else nemo(argv)
        return {"outcome": "completed" if rc in (0, None) else f"exit {rc}"}
    except SystemExit as exc:
        return {"outcome": "completed" if exc.code in (0, None) else f"exit {exc.code}"}
    except BaseException as exc:  # noqa: BLE001  (reported, not handled)
        text = f"{type(exc).__name__}: {exc}"
        if _NO_GPU.search(text):
            return {"outcome": "reached the GPU", "error": text.splitlines()[0][:300],
                    "where": "".join(traceback.format_exception(exc))[-2500:]}
        return {"outcome": "failed", "error": "".join(traceback.format_exception(exc))[-3000:]}


def _in_child(run) -> str:
    """``run()``'s text, computed in a forked copy of this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        with os.fdopen(write, "w") as out:
            out.write(run())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    os.waitpid(pid, 0)
    return text


def _import_on_this_machine(hf: Path, ckpt: Path) -> str:
    """The checkpoint the later entries read, imported with the machine's real answers (its CPU)."""
    for name, real in _REAL.items():
        setattr(torch.cuda, name, real)
    report = _run(["llm", "import", "--hf", str(hf), "--out", str(ckpt)])
    return json.dumps({**report, "loaded": sorted(m for m in sys.modules if m.startswith("bridge_ext"))})


def main(work: Path, hf: Path) -> None:
    reports = (work / "reports.jsonl").open("w")  # the entries print to stdout themselves
    setup = json.loads(_in_child(lambda: _import_on_this_machine(hf, work / "imported")) or "{}")
    if setup.get("outcome") != "completed":
        raise SystemExit(f"gpu_side_probe: the CPU import the entries read failed: {setup}")
    reports.write(json.dumps({"entry": "import on this machine's CPU (the control)", **setup}) + "\n")
    for name, argv in entries(work, hf).items():
        text = _in_child(lambda: json.dumps({**_run(argv), "loaded": sorted(
            m for m in sys.modules if m.startswith("bridge_ext"))}))
        report = json.loads(text) if text else {"outcome": "the child died", "loaded": []}
        reports.write(json.dumps({"entry": name, **report}) + "\n")
        reports.flush()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
