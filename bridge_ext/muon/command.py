"""``nemo llm muon-plan``: the routing manifest of a recipe (argparse only; the work is :func:`muon_plan`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from bridge_ext.muon.manifest import format_plan, muon_plan

__all__ = ["cmd_muon_plan", "register"]


def cmd_muon_plan(args: argparse.Namespace) -> int:
    plan = muon_plan(args.recipe, layout=args.layout)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(format_plan(plan))
    return 0


def register(subparsers: Any) -> None:
    """Add ``muon-plan`` to ``nemo llm`` (the ``register(subparsers)`` pattern of ``bridge_ext.convert``)."""
    p = subparsers.add_parser("muon-plan", help="which parameters Muon orthogonalizes, how, and at what cost",
                              description="Computed from the recipe's shipped HF config; no torch, no weights.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_muon_plan)
