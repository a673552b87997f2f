#!/usr/bin/env bash
# The GPU tier in one command (docs/launch.md, "The GPU tier"): on one GPU, under 8 minutes, writes
# $OUT/gpu_check.json and $OUT/gpu_check.md (OUT defaults to runs/gpu).
#
#   bench/gpu_check.sh                 # on the GPU machine, from the repository root
#   bench/gpu_check.sh --dry-run       # any machine: prints each step, checks every recipe and layout it names
#   bench/gpu_check.sh --te            # the Transformer Engine path (TE specs, fp8 rows, QK-clip, round trip);
#                                      # TE from TE_SITE (default bench/te/landed/site: bench/te/te.py install)
#   bench/gpu_check.sh --te --dry-run  # any machine: the --te plan, each config checked without importing TE
#   bench/gpu_check.sh --te --rehearse # any machine, CPU: the QK-clip and round-trip workers (bench/te/workers.py)
#                                      # on the local spec (add --recipe qwen3_proxy_muon for the smallest only)
#   bench/gpu_check.sh --fetch-wheels  # a machine with network: bench/gpu_wheels.txt into .whl/ (for a GPU
#                                      # machine that has PyTorch but neither the Megatron stack nor network)
#
# PYTHON picks the interpreter (default: .venv/bin/python where it exists, else python3). When that Python lacks
# Megatron Bridge, the wheels in .whl/ are installed with --no-deps into a folder of their own that goes first on
# PYTHONPATH (the machine's PyTorch stays); nothing else is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

TE=()
if [ "${1:-}" = "--te" ]; then
  TE=(--te)
  shift
  TE_SITE=${TE_SITE:-bench/te/landed/site}
  if [ "${1:-}" != "--dry-run" ] && [ "${1:-}" != "--rehearse" ]; then
    if [ ! -d "$TE_SITE/transformer_engine" ]; then
      echo "error: no Transformer Engine in $TE_SITE; bench/te/te.py receive/install first (docs/launch.md)" >&2
      exit 2
    fi
    export PYTHONPATH="$PWD/$TE_SITE:$PYTHONPATH" NVTE_FRAMEWORK=pytorch
  fi
fi

case "${1:-}" in
  --dry-run)
    exec "$PYTHON" bench/gpu_check.py --dry-run ${TE[@]+"${TE[@]}"} --out "$OUT" "${@:2}" ;;
  --rehearse)  # CPU: the Python that runs the repository's tests (bridge_ext imports Megatron Bridge without TE)
    exec "$PYTHON" bench/gpu_check.py --rehearse ${TE[@]+"${TE[@]}"} --out "$OUT" "${@:2}" ;;
  --fetch-wheels)
    mkdir -p .whl
    grep -v -e '^#' -e '^antlr4' -e '^nvidia-resiliency-ext' -e '^emerging-optimizers' bench/gpu_wheels.txt \
      | sed 's/ *#.*//' > .whl/.pins
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl -r .whl/.pins
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux_2_39_x86_64 -d .whl "$(grep '^nvidia-resiliency-ext' bench/gpu_wheels.txt | sed 's/ *#.*//')"
    "$PYTHON" -m pip wheel --no-deps -w .whl "$(grep '^antlr4' bench/gpu_wheels.txt | sed 's/ *#.*//')"
    cp requirements/wheels/emerging_optimizers-0.1.0-py3-none-any.whl .whl/
    rm -f .whl/.pins
    echo "$(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
    exit 0 ;;
esac

if ! "$PYTHON" -c "import megatron.bridge" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: $PYTHON has no Megatron Bridge and .whl/ holds no wheels; run bench/gpu_check.sh --fetch-wheels" \
         "on a machine with network (or make install) first" >&2
    exit 2
  fi
  SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
  echo "installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE (--no-deps; the machine's PyTorch stays)"
  wheels=$(ls .whl/*.whl | grep -v manylinux_2_39)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels
  # a wheel tagged for glibc 2.39 (the lock's platform pass): pip checks the tag against this machine's glibc
  # unless told the platform; its Python code is what runs
  for w in $(ls .whl/*manylinux_2_39*.whl 2>/dev/null); do
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 --implementation cp --abi cp312 "$w"
  done
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
exec "$PYTHON" bench/gpu_check.py ${TE[@]+"${TE[@]}"} --out "$OUT" "$@"
