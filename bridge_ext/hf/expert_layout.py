"""Routed-expert weights in Hugging Face checkpoints: one tensor per expert, or fused per layer.

Released Qwen3-MoE, DeepSeek-V3 and Kimi K2 checkpoints, and transformers 4's models, hold each routed expert
separately: ``<layer>.mlp.experts.<N>.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]). transformers 5's
models hold them fused: ``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (expert N's gate rows, then its up rows)
and ``<layer>.mlp.experts.down_proj`` [E, H, I] (transformers 5.8 ``conversion_mapping.py``, "qwen2_moe", used
for qwen3_moe and deepseek_v3: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``). Its ``from_pretrained``
fuses per-expert checkpoints on load and its ``save_pretrained`` writes them back per expert unless
``save_original_format=False``: a checkpoint written under transformers 5 may be either.

Megatron Bridge's mappings (0.3 to 0.6, ``qwen3_moe_bridge.py``, ``deepseek/common.py``) name the per-expert
tensors. So conversion works in that layout everywhere: what a checkpoint must hold is listed per expert,
fused checkpoints are read through :class:`ExpertSlice` views, and exports are written per expert, the layout
every transformers release loads (5 through its conversion mapping) and serving stacks read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, NamedTuple

__all__ = [
    "ExpertLayout",
    "ExpertSlice",
    "assemble",
    "expert_layout",
    "fused_name",
    "fused_shapes",
    "per_expert_shapes",
    "per_expert_views",
]

ExpertLayout = Literal["per_expert", "fused", "none"]

_FUSED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<n>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class ExpertSlice(NamedTuple):
    """Where one per-expert tensor lies in a fused one: ``fused[expert, rows[0]:rows[1]]`` (``rows`` None: all)."""

    fused: str
    expert: int
    rows: tuple[int, int] | None


def _names(experts: str, n: int) -> tuple[str, str, str]:
    return f"{experts}.{n}.gate_proj.weight", f"{experts}.{n}.up_proj.weight", f"{experts}.{n}.down_proj.weight"


def per_expert_views(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ExpertSlice]:
    """Per-expert name -> its place in a fused tensor, for every fused expert tensor among ``shapes``."""
    views: dict[str, ExpertSlice] = {}
    for name, shape in shapes.items():
        match = _FUSED.match(name)
        if match is None or len(shape) != 3:
            continue
        for n in range(shape[0]):
            gate, up, down = _names(match["experts"], n)
            if match["proj"] == "down_proj":
                views[down] = ExpertSlice(name, n, None)
            else:
                half = shape[1] // 2
                views[gate] = ExpertSlice(name, n, (0, half))
                views[up] = ExpertSlice(name, n, (half, shape[1]))
    return views


def per_expert_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each fused expert tensor replaced by the per-expert tensors it holds.

    Order: a layer's experts where its ``gate_up_proj`` was, expert by expert (gate, up, down), as transformers
    4's models list them.
    """
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tuple(shape)
            continue
        gate_up, down = (shapes.get(f"{match['experts']}.{p}") for p in ("gate_up_proj", "down_proj"))
        if match["proj"] == "down_proj" and gate_up is not None:
            continue  # listed with gate_up_proj
        for n in range(shape[0]):
            gate_name, up_name, down_name = _names(match["experts"], n)
            if gate_up is not None:
                out[gate_name] = out[up_name] = (gate_up[1] // 2, gate_up[2])
            if down is not None:
                out[down_name] = (down[1], down[2])
    return out


def fused_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The inverse of :func:`per_expert_shapes`: each layer's per-expert tensors as its two fused ones."""
    layers: dict[str, dict[str, Any]] = {}
    for name, shape in shapes.items():
        match = _PER_EXPERT.match(name)
        if match is not None:
            layer = layers.setdefault(match["experts"], {"count": 0})
            layer["count"] = max(layer["count"], int(match["n"]) + 1)
            layer[match["proj"]] = tuple(shape)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tuple(shape)
            continue
        layer = layers[match["experts"]]
        if "gate_proj" in layer and "up_proj" in layer:
            gate, up = layer["gate_proj"], layer["up_proj"]
            out.setdefault(f"{match['experts']}.gate_up_proj", (layer["count"], gate[0] + up[0], gate[1]))
        if "down_proj" in layer:
            out.setdefault(f"{match['experts']}.down_proj", (layer["count"], *layer["down_proj"]))
    return out


def fused_name(name: str) -> str | None:
    """The fused tensor that holds per-expert tensor ``name`` in a transformers 5 layout, or None."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    return f"{match['experts']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"


def expert_layout(names: Iterable[str]) -> ExpertLayout:
    """How ``names`` store routed experts; ValueError naming both when they mix the two layouts."""
    names = list(names)
    fused = next((n for n in names if _FUSED.match(n)), None)
    per_expert = next((n for n in names if _PER_EXPERT.match(n)), None)
    if fused and per_expert:
        raise ValueError(f"mixes fused ({fused}) and per-expert ({per_expert}) expert tensors")
    return "fused" if fused else "per_expert" if per_expert else "none"


def assemble(name: str, shape: tuple[int, ...], read: Callable[[str], Any]) -> Any:
    """Tensor ``name`` of a model, built from per-expert tensors (``read(per-expert name)``) when it is fused."""
    import torch

    match = _FUSED.match(name)
    if match is None:
        return read(name)
    parts = []
    for n in range(shape[0]):
        gate, up, down = _names(match["experts"], n)
        parts.append(read(down) if match["proj"] == "down_proj" else torch.cat([read(gate), read(up)], dim=0))
    return torch.stack(parts)
