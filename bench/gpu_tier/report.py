"""The GPU tier's measured table (``gpu_check.md``, the one docs/launch.md shows) from its results."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown"]


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
