"""``nemo llm muon-plan --recipe NAME``: which parameters Muon orthogonalizes, how, and at what cost
(``bridge_ext.muon.manifest``; no torch, no weights)."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help="which parameters Muon orthogonalizes, how, and at what cost",
                              description="Computed from the recipe's shipped HF config; no torch, no weights.")
    p.add_argument("--recipe", required=True)
    p.add_argument("--layout", help="a layout name from the recipe's list (default: its first)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from bridge_ext.muon.manifest import format_plan, muon_plan

    plan = muon_plan(args.recipe, layout=args.layout)
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
    return 0
