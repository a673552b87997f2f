"""Each patch row that applies on this stack, switched off, must make its proving test fail (issue 39).

    python tests/prove_patches.py [NAME ...] [--no-redirects] [--timeout S] [--json FILE]

For each row (default: every row that applies here and names a test, bridge_ext/patches/evidence.py) runs
``pytest <test> -x`` in a fresh process with ``BRIDGE_EXT_PATCHES_OFF=<row>`` and prints one line per row:
``needed`` (the test failed: the bug is real on this stack), ``NOT SHOWN`` (the test passed without the row:
upstream fixed it, or the test does not reach the row's code), ``timeout``. Exit 1 when a row is not shown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--no-redirects", action="store_true", help="leave out CPU mode's cuda-on-cpu rows")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bridge_ext import patches
    from bridge_ext.patches import evidence
    from bridge_ext.patches.registry import SWITCH_OFF_ENV

    unknown = sorted(set(args.names) - {p.name for p in patches.REGISTRY})
    if unknown:
        print(f"error: no patch row named {', '.join(unknown)} (python -m bridge_ext.patches lists them)",
              file=sys.stderr)
        return 2
    here = patches.applied_here()
    names = args.names or [name for name in here if evidence.proven_by(name)
                           and not (args.no_redirects and name.startswith("cuda-on-cpu "))]
    results, failed = [], False
    for name in names:
        test = evidence.proven_by(name)
        if name not in here or test is None:
            results.append({"row": name, "test": test, "result": "does not apply here" if test else "no test"})
            print(f"{name}: {results[-1]['result']}", flush=True)
            continue
        start = time.time()
        env = {**os.environ, SWITCH_OFF_ENV: ",".join((name, *evidence.SWITCHED_WITH.get(name, ())))}
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", test, "-x", "-q", "-p", "no:cacheprovider"],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            result = "needed" if done.returncode == 1 else "NOT SHOWN" if done.returncode == 0 else \
                f"pytest exit {done.returncode}"
            last = (done.stdout.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            result, last = "timeout", ""
        failed |= result != "needed"
        results.append({"row": name, "test": test, "result": result, "seconds": round(time.time() - start),
                        "pytest": last})
        print(f"{name}: {result} ({results[-1]['seconds']} s; {test}: {last})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
