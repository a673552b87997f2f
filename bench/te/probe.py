"""Does Transformer Engine work on this GPU: import, one te.Linear forward/backward, one fused attention forward
(bf16), each timed. Run by ``python3 bench/te/te.py probe`` (the carried site first on PYTHONPATH).

Prints one JSON line at the end (``probe: {...}``) with the seconds of each stage: the numbers docs/launch.md
needs to decide what else fits in the session's device time. Exit 1 when a stage fails (its error printed).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> int:
    out: dict = {}
    t0 = time.perf_counter()

    def stage(name, fn):
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - report which stage broke, keep the earlier numbers
            traceback.print_exc()
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            return None
        out[name] = {"ok": True, "s": round(time.perf_counter() - start, 3)}
        if isinstance(value, dict):
            out[name].update(value)
        return value

    import torch

    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    if not torch.cuda.is_available():
        print("error: no GPU visible", file=sys.stderr)
        return 2
    out["gpu"] = torch.cuda.get_device_name(0)
    te = stage("import", lambda: __import__("transformer_engine.pytorch", fromlist=["Linear"]))
    if te is None:
        print("probe: " + json.dumps(out))
        return 1
    import transformer_engine

    out["te"] = getattr(transformer_engine, "__version__", "?")
    out["te_file"] = os.path.dirname(transformer_engine.__file__)
    out["cudnn"] = str(te.get_cudnn_version()) if hasattr(te, "get_cudnn_version") else "?"
    out["fp8_available"] = str(te.is_fp8_available()) if hasattr(te, "is_fp8_available") else "?"

    def timed(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def linear() -> dict:
        layer = te.Linear(4096, 4096, bias=False, params_dtype=torch.bfloat16).cuda()
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        first = time.perf_counter()
        layer(x).sum().backward()
        torch.cuda.synchronize()
        first = time.perf_counter() - first
        ms = timed(lambda: layer(x).sum().backward())
        flops = 3 * 2 * 8192 * 4096 * 4096  # forward + two backward GEMMs
        return {"first_call_s": round(first, 3), "fwd_bwd_ms": round(ms, 3),
                "tflops": round(flops / (ms / 1e3) / 1e12, 1)}

    def attention() -> dict:
        s, b, h, d = 4096, 4, 16, 128
        attn = te.DotProductAttention(h, d, attn_mask_type="causal", qkv_format="sbhd").cuda()
        q, k, v = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        os.environ.setdefault("NVTE_DEBUG", "1")
        first = time.perf_counter()
        o = attn(q, k, v)
        torch.cuda.synchronize()
        first = time.perf_counter() - first
        ms = timed(lambda: attn(q, k, v))
        flops = 4 * b * h * s * s * d / 2  # causal
        backend = None
        try:  # which backend TE picked (FusedAttention / FlashAttention / UnfusedDotProductAttention)
            from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

            backend = str(getattr(dpa_utils, "_attention_backends", {}).get("backend_selection_requires_update"))
        except Exception:  # noqa: BLE001
            pass
        return {"shape_sbhd": [s, b, h, d], "out_shape": list(o.shape), "first_call_s": round(first, 3),
                "fwd_ms": round(ms, 3), "tflops": round(flops / (ms / 1e3) / 1e12, 1), "backend_note": backend}

    os.environ.setdefault("NVTE_FUSED_ATTN", "1")
    stage("linear_bf16", linear)
    stage("fused_attention_bf16", attention)
    out["total_s"] = round(time.perf_counter() - t0, 2)
    print("probe: " + json.dumps(out), flush=True)
    return 0 if all(v.get("ok") for v in out.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
