"""The stacks' install files (requirements/, Makefile): exact locks that agree with their curated lists, the
venv holding its lock, the platform pass's wheel pinned and its native part never loaded on CPU."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REQ = REPO / "requirements"
STACKS = re.search(r"^STACKS := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1).split()
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s#;]+)")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a requirements file (extras, hashes and comments ignored)."""
    return {_name(m.group(1)): m.group(2) for line in path.read_text().splitlines() if (m := _PIN.match(line))}


def _vendored() -> dict[str, str]:
    """Wheel file name -> recorded sha256, from requirements/wheels/SHA256SUMS."""
    lines = (REQ / "wheels" / "SHA256SUMS").read_text().splitlines()
    return {line.split()[1]: line.split()[0] for line in lines if line and not line.startswith("#")}


@pytest.mark.once
@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_lock_agrees_with_its_lists(stack):
    lock = _pins(REQ / f"lock-{stack}.txt")
    assert lock, f"lock-{stack}.txt pins nothing"
    curated = _pins(REQ / f"stack-{stack}.txt") | _pins(REQ / f"stack-{stack}-nodeps.txt")
    assert {n: v for n, v in curated.items() if lock.get(n) != v} == {}, f"re-run make lock STACK={stack}"
    platform = REQ / f"stack-{stack}-platform.txt"
    if platform.exists():
        lines = [line for line in platform.read_text().splitlines() if _PIN.match(line)]
        assert lines and all(re.search(r"--hash=sha256:[0-9a-f]{64}\b", line) for line in lines)
        assert set(_pins(platform)).isdisjoint(lock), "the platform pass's packages are pinned in its own file"
    for file, digest in _vendored().items():
        name, version = file.split("-")[:2]
        if lock.get(_name(name)) == version:
            assert hashlib.sha256((REQ / "wheels" / file).read_bytes()).hexdigest() == digest, file


@pytest.mark.once
def test_an_unknown_stack_is_one_line_naming_the_stacks():
    run = subprocess.run(["make", "-s", "-n", "install", "STACK=nope"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert len(lines) == 1 and "unknown STACK=nope" in lines[0] and all(s in lines[0] for s in STACKS), lines


def _installed_stack() -> str | None:
    """The stack `make install` put into this venv (its stamp), or None outside such a venv (a container)."""
    stamps = [p.name.removeprefix(".installed-") for p in Path(sys.prefix).glob(".installed-*")]
    return stamps[0] if len(stamps) == 1 else None


@pytest.mark.stack
def test_the_venv_holds_exactly_its_lock():
    stack = _installed_stack()
    if stack is None:
        pytest.skip("not a venv made by make install (no .installed-<STACK> stamp)")
    wanted = _pins(REQ / f"lock-{stack}.txt")
    platform = REQ / f"stack-{stack}-platform.txt"
    if platform.exists():
        wanted |= _pins(platform)
    # Only the venv's own site-packages: setuptools puts its vendored copies (packaging, zipp, ...) on sys.path.
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=site)}
    assert {n: (v, installed.get(n)) for n, v in wanted.items() if installed.get(n) != v} == {}


@pytest.mark.stack
@pytest.mark.slow
def test_nvidia_resiliency_ext_native_part_is_never_loaded_on_cpu():
    """Its CUPTI extension needs a newer glibc (2.39) and a GPU; importing Megatron's training code (which
    imports NVRX) must not load it. Checked in a fresh process through the loaded shared objects."""
    try:
        files = metadata.files("nvidia-resiliency-ext") or []
    except metadata.PackageNotFoundError:
        pytest.skip("nvidia-resiliency-ext is not installed")
    natives = [f.name for f in files if f.name.endswith(".so")]
    assert natives, "the real wheel ships its native part"
    code = (
        "import bridge_ext, nvidia_resiliency_ext, megatron.core, megatron.bridge.training.pretrain\n"
        "print(open('/proc/self/maps').read())"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [n for n in natives if n in run.stdout] == []
