"""Several ``nemo llm import|export`` commands in one process per rank (for tests/test_convert_distributed.py).

Run as ``torchrun --nproc-per-node 2 tests/convert_rank_driver.py OUT 'llm import --hf A --out B --ep 2' ...``:
each command goes through :func:`bridge_ext.commands.main`, the ``nemo`` entry point, so one launch pays the
libraries' import once for several conversions. The first command runs exactly as
``torchrun ... $(which nemo) llm ...`` does: the conversion makes its gloo group from torchrun's environment
and ends it. A second ``init_process_group`` from the same environment would read the first one's stale
addresses from torchrun's store, so for each later command the driver makes the group itself, on a fresh
prefix of that store, and the conversion uses it. Rank R writes ``OUT/rank<R>.json`` =
[{argv, rc, seconds, maxrss_mb}] (a command that fails with exit code 2 does not stop the next).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def main(out: Path, commands: list[str]) -> int:
    from bridge_ext.commands import main as nemo

    records = []
    for number, command in enumerate(commands):
        start = time.perf_counter()
        if number == 0:
            rc = nemo(shlex.split(command))
        else:
            with _group(f"command-{number}"):
                rc = nemo(shlex.split(command))
        records.append({"argv": command, "rc": rc, "seconds": round(time.perf_counter() - start, 2),
                        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})  # fmt: skip
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(records, indent=1))
    return 0


@contextlib.contextmanager
def _group(prefix: str) -> Iterator[None]:
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=300))  # fmt: skip
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=int(os.environ["RANK"]), world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def launch(commands: list[str], cwd: Path, *, timeout: int = 900) -> tuple[list[list[dict]], subprocess.CompletedProcess]:
    """Runs ``commands`` in one 2-process ``torchrun`` launch from this interpreter's venv; asserts it succeeded and
    returns each rank's records and the launch's result."""
    out = cwd / "ranks"
    out.mkdir(exist_ok=True)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    # --standalone: a rendezvous on a free local port (never a fixed 29500), so launches cannot collide
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", os.path.abspath(__file__),
                             str(out), *commands], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)], result


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
