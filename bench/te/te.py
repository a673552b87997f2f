"""Transformer Engine for the lent GPU machine (no network, 64 MiB per call): download here, carry in pieces,
reassemble, check, install and build there, then probe. docs/launch.md, "The TE path on the lent GPU".

Here (a machine with the package index):

    python bench/te/te.py fetch     # TE 2.20.2 (core wheel, metapackage, torch sdist) + the few wheels TE
                                    # imports that the GPU image lacks, into bench/te/dist/ (git-ignored)
    python bench/te/te.py split     # the core wheel in pieces of <= 56 MiB + sha256 manifest: bench/te/pieces/
    python bench/te/te.py check     # pieces against the manifest; each call's carry under the 64 MiB limit
    python bench/te/te.py plan      # the sequence of device calls (carry + command), with estimated seconds

There (each command from the repository root, on the machine's own python3 with PyTorch 2.11 + CUDA 13.0):

    python3 bench/te/te.py receive  # every carried bench/te/pieces/part-NN: sha256 per file, moved to
                                    # bench/te/landed/ (git-ignored: stays while the machine stays up)
    python3 bench/te/te.py install  # reassemble + sha256 of the whole wheel; build transformer_engine_torch
                                    # from the sdist (offline, against this PyTorch); one pip install --target
    python3 bench/te/te.py probe    # bench/te/probe.py on that site: import, te.Linear, fused attention

Each subcommand prints its own wall time. Standard library only (the GPU image's python3 runs it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DIST = HERE / "dist"          # downloads (here)
PIECES = HERE / "pieces"      # what the device calls carry, one part-NN folder per call
LANDED = HERE / "landed"      # on the device: received pieces, the wheel, the build, the site
SITE = LANDED / "site"
MANIFEST = "manifest.json"

TE_VERSION = "2.20.2"
CORE = f"transformer-engine-cu13=={TE_VERSION}"      # the prebuilt core library (~276 MB wheel)
META = f"transformer-engine=={TE_VERSION}"           # the metapackage: TE's import asserts it is installed with
                                                     # the same version as the core and the torch extension
TORCH_SDIST = f"transformer-engine-torch=={TE_VERSION}"  # 0.5 MB sdist: a CppExtension built against PyTorch
# Imported by transformer_engine.pytorch (or megatron-core's TE path) and absent from the GPU image's package
# list (/work/.library/device/KINDS.md): pydantic (transformer_engine.common.recipe) and its three needs at
# bench/gpu_wheels.txt's pins, nvdlfw-inspect (transformer_engine.debug), nvidia-cudnn-frontend (TE's pip
# requirement; its Python API backs some fused paths).
EXTRAS = ("pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "nvdlfw-inspect==0.2.2", "nvidia-cudnn-frontend==1.32.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "any")

MIB = 2**20
PIECE_BYTES = 56 * MIB   # the call limit is 64 MiB for the whole working tree: ~3 MiB tracked + margin
CALL_LIMIT = 64 * MIB

# Build settings for transformer_engine_torch (read from its sdist: setup.py, build_tools/{utils,pytorch}.py):
BUILD_ENV = {
    "NVTE_FRAMEWORK": "pytorch",              # build_tools.utils.get_frameworks: the torch extension only
    "NVTE_PYTORCH_FORCE_BUILD": "TRUE",       # setup.py CachedWheelsCommand: else it first tries to download a
                                              # prebuilt wheel from GitHub (no network there)
    "NVTE_CUDA_ARCHS": "90",                  # build_tools.utils.cuda_archs: Hopper only
    "TORCH_CUDA_ARCH_LIST": "9.0",            # torch.utils.cpp_extension, for any CUDA source (there is none)
    "NVTE_WITH_NCCL_EP": "0",                 # no NCCL EP bindings (no NCCL headers needed; MoE uses alltoall)
    "MAX_JOBS": "16",                         # ninja -j (the machine's 16 cores)
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _platform_args() -> list[str]:
    out = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def fetch() -> None:
    DIST.mkdir(parents=True, exist_ok=True)
    _pip("download", "-q", "--no-deps", *_platform_args(), "-d", str(DIST), CORE, META, *EXTRAS)
    # the sdist: pip prepares its metadata here (imports torch; ~1 min), nothing is compiled
    _pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", str(DIST), TORCH_SDIST)
    for f in sorted(DIST.iterdir()):
        print(f"{f.stat().st_size / MIB:8.1f} MiB  {f.name}")


def _core_wheel(folder: Path) -> Path:
    found = sorted(folder.glob(f"transformer_engine_cu13-{TE_VERSION}-*.whl"))
    if len(found) != 1:
        raise SystemExit(f"error: expected one transformer_engine_cu13-{TE_VERSION} wheel in {folder}, found {found}")
    return found[0]


def split(piece_bytes: int = PIECE_BYTES) -> dict:
    wheel = _core_wheel(DIST)
    t0 = time.perf_counter()
    whole = sha256(wheel)
    t_hash = time.perf_counter() - t0
    extras = sorted(f for f in DIST.iterdir() if f != wheel and f.is_file())
    if PIECES.exists():
        shutil.rmtree(PIECES)
    pieces = []
    t0 = time.perf_counter()
    with wheel.open("rb") as src:
        i = 0
        while chunk := src.read(piece_bytes):
            i += 1
            name = f"{wheel.name}.{i:02d}"
            part = PIECES / f"part-{i:02d}"
            part.mkdir(parents=True)
            (part / name).write_bytes(chunk)
            pieces.append({"name": name, "part": part.name, "bytes": len(chunk),
                           "sha256": hashlib.sha256(chunk).hexdigest()})
    t_split = time.perf_counter() - t0
    # the small files ride with the last piece when they fit, else in a part of their own
    extra_bytes = sum(f.stat().st_size for f in extras)
    last = PIECES / pieces[-1]["part"]
    target = last if pieces[-1]["bytes"] + extra_bytes <= piece_bytes else PIECES / f"part-{len(pieces) + 1:02d}"
    target.mkdir(parents=True, exist_ok=True)
    files = []
    for f in extras:
        shutil.copy2(f, target / f.name)
        files.append({"name": f.name, "part": target.name, "bytes": f.stat().st_size, "sha256": sha256(f)})
    manifest = {"te_version": TE_VERSION, "wheel": {"name": wheel.name, "bytes": wheel.stat().st_size,
                                                    "sha256": whole},
                "piece_bytes": piece_bytes, "pieces": pieces, "files": files,
                "parts": sorted({p["part"] for p in pieces} | {f["part"] for f in files}),
                "measured_here": {"sha256_whole_s": round(t_hash, 2), "split_s": round(t_split, 2)}}
    for part in manifest["parts"]:  # each part carries the manifest: whichever arrives first can check itself
        (PIECES / part / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{wheel.name}: {wheel.stat().st_size / MIB:.1f} MiB, sha256 {whole} ({t_hash:.1f} s); "
          f"{len(pieces)} pieces of <= {piece_bytes / MIB:.0f} MiB ({t_split:.1f} s); {len(files)} small files "
          f"in {target.name}; parts: {', '.join(manifest['parts'])}")
    return manifest


def _tracked_bytes() -> int:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((REPO / n).stat().st_size for n in names.decode().split("\0") if n and (REPO / n).is_file())


def part_bytes(part: Path) -> int:
    return sum(f.stat().st_size for f in part.rglob("*") if f.is_file())


def check() -> int:
    """Here: every piece and file matches the manifest; each call (tracked tree + one part) fits 64 MiB."""
    manifest = json.loads((PIECES / "part-01" / MANIFEST).read_text())
    problems, t0 = [], time.perf_counter()
    for entry in manifest["pieces"] + manifest["files"]:
        path = PIECES / entry["part"] / entry["name"]
        if not path.exists() or sha256(path) != entry["sha256"]:
            problems.append(f"{path.relative_to(REPO)}: missing or sha256 differs")
    joined = hashlib.sha256()
    for entry in manifest["pieces"]:
        with (PIECES / entry["part"] / entry["name"]).open("rb") as f:
            joined.update(f.read())
    if joined.hexdigest() != manifest["wheel"]["sha256"]:
        problems.append("the pieces joined do not give the wheel's sha256")
    tracked = _tracked_bytes()
    for part in manifest["parts"]:
        size = part_bytes(PIECES / part)
        if tracked + size > CALL_LIMIT:
            problems.append(f"{part}: {size / MIB:.1f} MiB + tracked {tracked / MIB:.1f} MiB > 64 MiB")
    print(f"checked {len(manifest['pieces'])} pieces + {len(manifest['files'])} files and the joined wheel in "
          f"{time.perf_counter() - t0:.1f} s; tracked tree {tracked / MIB:.1f} MiB; "
          + ", ".join(f"{p} {part_bytes(PIECES / p) / MIB:.1f} MiB" for p in manifest["parts"]))
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def plan(manifest: dict | None = None) -> list[dict]:
    """The device calls, in order (docs/launch.md): the same list ``plan`` prints."""
    if manifest is None:
        manifest = json.loads((PIECES / "part-01" / MANIFEST).read_text())
    parts = manifest["parts"]
    calls = [{"carry": [f"bench/te/pieces/{p}"], "command": "python3 bench/te/te.py receive",
              "estimate_s": 35, "why": f"{part_bytes(PIECES / p) / MIB:.0f} MiB travel; sha256 + move (~1 s)"}
             for p in parts[:-1]]
    calls.append({"carry": [f"bench/te/pieces/{parts[-1]}"],
                  "command": "python3 bench/te/te.py receive && python3 bench/te/te.py install && "
                             "python3 bench/te/te.py probe",
                  "estimate_s": 240, "why": "last piece + sdist + small wheels; reassemble + sha256 (~2 s), build "
                                            "transformer_engine_torch (33 C++ files, ninja -j16), one pip install, "
                                            "probe (CUDA context, cuDNN, first kernels)"})
    calls.append({"carry": [".whl"], "command": "TE_SITE=bench/te/landed/site bench/gpu_check.sh --te",
                  "estimate_s": 480, "why": "the Megatron stack's 54 wheels (47 MB); the check on the TE spec"})
    return calls


def print_plan() -> None:
    calls = plan()
    total = 0
    print("Device calls, back to back (the machine is given back after 30 s idle: a gap longer than that loses "
          "bench/te/landed/ and starts again from call 1):")
    for i, c in enumerate(calls, 1):
        total += c["estimate_s"]
        print(f"{i:2d}. carry {json.dumps(c['carry'])}\n    {c['command']}\n    ~{c['estimate_s']} s: {c['why']}")
    print(f"estimated device time: ~{total} s + the first start (60-120 s) + idle gaps (<= 30 s each); "
          f"budget 900 s")


def receive() -> int:
    t0 = time.perf_counter()
    LANDED.mkdir(parents=True, exist_ok=True)
    got = 0
    for part in sorted(PIECES.glob("part-*")):
        manifest = json.loads((part / MANIFEST).read_text())
        shutil.copy2(part / MANIFEST, LANDED / MANIFEST)
        expected = {e["name"]: e for e in manifest["pieces"] + manifest["files"] if e["part"] == part.name}
        for name, entry in expected.items():
            src = part / name
            if not src.exists():
                print(f"error: {part.name}/{name} did not arrive", file=sys.stderr)
                return 1
            if sha256(src) != entry["sha256"]:
                print(f"error: {part.name}/{name}: sha256 differs from the manifest", file=sys.stderr)
                return 1
            shutil.move(str(src), LANDED / name)
            got += 1
    have = sorted(p.name for p in LANDED.iterdir())
    print(f"receive: {got} files checked and moved in {time.perf_counter() - t0:.1f} s; landed: {len(have)} files")
    return 0


def install() -> int:
    manifest = json.loads((LANDED / MANIFEST).read_text())
    missing = [e["name"] for e in manifest["pieces"] + manifest["files"] if not (LANDED / e["name"]).exists()]
    if missing:
        print(f"error: not landed yet: {', '.join(missing)}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    wheel = LANDED / manifest["wheel"]["name"]
    with wheel.open("wb") as out:
        for entry in manifest["pieces"]:
            with (LANDED / entry["name"]).open("rb") as f:
                shutil.copyfileobj(f, out, 16 * MIB)
    digest = sha256(wheel)
    if digest != manifest["wheel"]["sha256"]:
        print(f"error: reassembled wheel sha256 {digest} != {manifest['wheel']['sha256']}", file=sys.stderr)
        return 1
    for entry in manifest["pieces"]:
        (LANDED / entry["name"]).unlink()
    print(f"install: reassembled {wheel.name} ({wheel.stat().st_size / MIB:.1f} MiB), sha256 ok, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    t1 = time.perf_counter()
    built = LANDED / "built"
    built.mkdir(exist_ok=True)
    sdist = next(LANDED.glob(f"transformer_engine_torch-{TE_VERSION}.tar.gz"))
    env = {**os.environ, **BUILD_ENV}
    print("+ " + " ".join(f"{k}={v}" for k, v in BUILD_ENV.items()), flush=True)
    # --no-build-isolation: its build requirements (setuptools, pip, torch, wheel) are this python's, and the
    # extension must be compiled against this PyTorch; --no-index: nothing is fetched
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(built),
           str(sdist)]
    print("+", " ".join(cmd), flush=True)
    log = LANDED / "build.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(log.read_text(errors="replace")[-6000:], file=sys.stderr)
        print(f"error: building transformer_engine_torch failed (exit {rc}; {log})", file=sys.stderr)
        return 1
    torch_wheel = next(built.glob("transformer_engine_torch-*.whl"))
    print(f"install: built {torch_wheel.name} in {time.perf_counter() - t1:.1f} s", flush=True)
    t2 = time.perf_counter()
    # one pip command for all: the core wheel, the metapackage and the extension share the transformer_engine/
    # folder, and a second `pip install --target` would skip (or with --upgrade, replace) that folder
    wheels = [wheel, torch_wheel] + [LANDED / e["name"] for e in manifest["files"] if e["name"].endswith(".whl")]
    if SITE.exists():
        shutil.rmtree(SITE)
    _pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(SITE),
         *map(str, wheels))
    print(f"install: {len(wheels)} wheels into {SITE.relative_to(REPO)} in {time.perf_counter() - t2:.1f} s; "
          f"all {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def probe() -> int:
    env = {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NVTE_FRAMEWORK": "pytorch", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(HERE / "probe.py")], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=("fetch", "split", "check", "plan", "receive", "install", "probe"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rc = {"fetch": lambda: fetch() or 0, "split": lambda: split() and 0, "check": check,
          "plan": lambda: print_plan() or 0, "receive": receive, "install": install, "probe": probe}[args.step]()
    print(f"[te.py {args.step}: {time.perf_counter() - t0:.1f} s, exit {rc}]", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
