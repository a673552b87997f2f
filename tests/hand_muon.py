"""Muon's Newton-Schulz iteration written out for tests: an independent second implementation to compare
megatron-core / emerging-optimizers against (Keller Jordan's coefficients; Moonlight, arXiv 2502.16982,
Algorithm 1)."""

from __future__ import annotations

import torch

__all__ = ["KJ", "newton_schulz"]

KJ = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic coefficients (the moonlight and kimi_k2 presets)


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """``steps`` iterations on the wide orientation, in ``g``'s dtype (pass float64 for a reference)."""
    a, b, c = KJ
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x
