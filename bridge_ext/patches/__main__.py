"""``python -m bridge_ext.patches [--markdown]``: every patch and whether it applies on the installed stack."""

from __future__ import annotations

import argparse
import sys

from bridge_ext.patches.registry import markdown, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_ext.patches", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print docs/patches.md")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    for row in table():
        print(f"{row['name']:44} {row['area']:13} {row['scope']:13} {row['applies here']:4} {row['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
