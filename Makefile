# `make demo` and `make test` work on a fresh clone: they create a venv with Python 3.12 and install the
# pinned Megatron stack (first run: a few minutes, ~6-8 GB; later runs reuse the venv).
#
# STACK picks the exact lock, requirements/lock-$(STACK).txt, each in its own venv (docs/stacks.md):
#   26.02     (default, .venv) the NeMo 26.02 container: megatron-bridge 0.3.0, megatron-core 0.16.0,
#             emerging-optimizers 0.1.0, NeMo-Run 0.8.0, PyTorch 2.10
#   26.04.01  (.venv-26.04.01) NeMo 26.04.01: 0.4.2 / 0.17.1 / 0.1.0, NeMo-Run 0.9.0, PyTorch 2.11
#   26.06.01  (.venv-26.06.01) NeMo 26.06.01: 0.5.1 / 0.18.2 / 0.2.0, NeMo-Run 0.10.0, PyTorch 2.12
#   26.08     (.venv-26.08)    NeMo 26.08: 0.6.0 / 0.19.0 / 0.2.0, NeMo-Run 0.10.0, PyTorch 2.13
#   newest    (.venv-newest)   the newest releases on the package index: 0.6.2 / 0.19.2 / 0.3.0, PyTorch 2.14.1
SHELL := /bin/bash
# Bytecode: uv compiles the lock's at install (--compile-bytecode, as pip does: compiled lazily instead, the
# processes a test starts at once each compiled the same modules: a fresh 26.08 venv ran its CI selection in 435 s,
# 375 s compiled at install, docs/testing.md); our own modules and pytest's rewritten tests are written on first
# import even where the environment sets PYTHONDONTWRITEBYTECODE (this one does).
unexport PYTHONDONTWRITEBYTECODE
STACK ?= 26.02
STACKS := 26.02 26.04.01 26.06.01 26.08 newest
ifneq ($(words $(STACK)) $(filter $(STACK),$(STACKS)),1 $(STACK))
$(error unknown STACK=$(STACK); choose one of: $(STACKS))
endif
VENV ?= $(if $(filter 26.02,$(STACK)),.venv,.venv-$(STACK))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(STACK)
LOCK := requirements/lock-$(STACK).txt
# Wheels that are not on the package index (emerging-optimizers 0.1.0, 0.2.0); see requirements/wheels/README.md.
WHEELS := requirements/wheels
# Pass 3, where a stack has one: upstream wheels tagged for a newer glibc than these machines' (2.36), pinned by
# hash, downloaded for that platform and installed unmodified with `python -m installer` (pip refuses a wheel
# whose platform tag the machine lacks; installer applies the wheel spec without that check). docs/stacks.md.
PLATFORM_REQS := requirements/stack-$(STACK)-platform.txt
PLATFORM := manylinux_2_39_x86_64
PLATFORM_PKGS := $(if $(wildcard $(PLATFORM_REQS)),$(shell sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' $(PLATFORM_REQS)))

# A working Python 3.12: $PYTHON, python3.12 on PATH, or a pyenv / system install.
PY312_CHECK := -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'
ifndef PYTHON
PYTHON := $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) /usr/bin/python3.12 /usr/local/bin/python3.12,$(shell $(p) $(PY312_CHECK) >/dev/null 2>&1 && echo $(p))))
endif

.PHONY: install demo test test-fast generate yaml lock clean check-wheels

# Every wheel the stack takes from $(WHEELS) must be there with the recorded checksum.
check-wheels:
	@grep -v '^#' requirements/wheels/SHA256SUMS | while read -r sum file; do \
	  if ! grep -qi "^$$(echo $$file | cut -d- -f1 | tr _ -)==$$(echo $$file | cut -d- -f2)\b" \
	       $(wildcard $(LOCK)) requirements/stack-$(STACK)-nodeps.txt; then continue; fi; \
	  if [ ! -f "$(WHEELS)/$$file" ]; then \
	    echo "error: $(WHEELS)/$$file is missing. Build it from the v$$(echo $$file | cut -d- -f2) tag of" \
	         "NVIDIA-NeMo/Emerging-Optimizers (pip wheel --no-deps .) and put it there"; exit 2; fi; \
	  echo "$$sum  $(WHEELS)/$$file" | sha256sum --check --status || { \
	    echo "error: $(WHEELS)/$$file does not match its SHA256SUMS entry; replace it with the upstream build"; exit 2; }; \
	done

define MAKE_VENV
	@if [ ! -x $(PY) ]; then \
	  if [ -z "$(PYTHON)" ]; then \
	    echo "error: no Python 3.12 found. Install one (pyenv install 3.12, or apt install python3.12)" \
	         "or pass PYTHON=/path/to/python3.12"; exit 2; fi; \
	  echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV) || exit 2; fi
	@$(PY) $(PY312_CHECK) || { echo "error: $(VENV) is not Python 3.12; remove it (make clean) and retry"; exit 2; }
endef

# Pass 3 (see PLATFORM_REQS); a no-op for stacks without a platform file, and offline when every pin is installed.
PLATFORM_INSTALLED := -c 'import re, sys; from importlib.metadata import version; \
  pins = [m for line in open(sys.argv[1]) if (m := re.match(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line))]; \
  sys.exit(any(version(m[1]) != m[2] for m in pins))'
define PLATFORM_PASS
	@if [ -f $(PLATFORM_REQS) ] && $(PY) $(PLATFORM_INSTALLED) $(PLATFORM_REQS) 2>/dev/null; then \
	  echo "pass 3: $(PLATFORM_PKGS) already installed as pinned"; \
	elif [ -f $(PLATFORM_REQS) ]; then set -e; \
	  rm -rf $(VENV)/platform-wheels; \
	  echo "pass 3: $(PLATFORM_PKGS) (wheels for $(PLATFORM), installed unmodified)"; \
	  $(PY) -m pip download --no-deps --only-binary=:all: --platform $(PLATFORM) --implementation cp \
	    --python-version 3.12 --abi cp312 --require-hashes -d $(VENV)/platform-wheels -r $(PLATFORM_REQS); \
	  $(PY) -m pip uninstall -y -q $(PLATFORM_PKGS) 2>/dev/null || true; \
	  for w in $(VENV)/platform-wheels/*.whl; do $(PY) -m installer "$$w"; done; \
	  rm -rf $(VENV)/platform-wheels; fi
endef

install: $(STAMP)

$(LOCK):
	@echo "error: $(LOCK) is missing; write it with make lock STACK=$(STACK) (network)"; exit 2

# The lock's packages go in with uv's `pip install` (requirements/installer.txt: pinned by hash; 61 s for 26.08's
# lock with its bytecode, where pip took 200 s for 26.02's), or with pip where uv cannot install; the same lock,
# --no-deps either way.
# (decided by the shell as each line runs: make expands a recipe's lines before running its first)
INSTALLER = $$([ -x $(VENV)/bin/uv ] && echo '$(VENV)/bin/uv pip install --python $(PY)' || echo '$(PY) -m pip install')

$(STAMP): $(LOCK) $(wildcard $(PLATFORM_REQS)) pyproject.toml requirements/installer.txt | check-wheels
	$(MAKE_VENV)
	@$(PY) -m pip install -q --no-deps --require-hashes -r requirements/installer.txt \
	  || echo "uv did not install (requirements/installer.txt); installing the lock with pip"
	$(INSTALLER) --no-deps --find-links $(WHEELS) -r $(LOCK) $$([ -x $(VENV)/bin/uv ] && echo --compile-bytecode)
	$(PLATFORM_PASS)
	$(INSTALLER) --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

DEMO_RUN ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

# Trains the Kimi K2 proxy (MLA + MoE, MuonClip) with Muon on CPU on real text (~1 minute), then prints
# where the checkpoint, the TensorBoard log and the loss curve are. The full recipe's validated config:
# `nemo llm pretrain --recipe kimi_k2_muon --dryrun`.
demo: install
	$(VENV)/bin/nemo llm pretrain --recipe kimi_k2_proxy_muon checkpoint.save=$(DEMO_RUN)/checkpoints \
	  checkpoint.load=$(DEMO_RUN)/checkpoints logger.tensorboard_dir=$(DEMO_RUN)/tb_logs

# PYTEST_ARGS narrows a run, e.g. PYTEST_ARGS='-m "stack and not heavy and not once"' (.ci/run's 26.08 run).
# PYTEST_WORKERS: two, CI's cores (three measured no faster in CI, where the next stack installs beside the tests:
# 26.08 377 s with three, 378 s with two; docs/testing.md). Whole modules to a worker (--dist loadfile: a module's
# fixtures are made once), the costliest modules first (tests/conftest.py), so the workers end together.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=15 $(PYTEST_ARGS)

test-fast: install  # everything but the tests marked slow
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not slow"

generate: install  # regenerate yaml/<recipe>.yaml and docs/recipes.md from the Python recipes
	$(PY) -m bridge_ext.shipped_files

yaml: generate

# Re-resolves the curated lists in a fresh $(VENV) (so nothing stale enters the lock) and rewrites the lock,
# keeping its header comment; the platform pass's packages stay out of it (their file pins them). Needs network.
lock: check-wheels
	rm -rf $(VENV)
	$(MAKE_VENV)
	$(PY) -m pip install -r requirements/stack-$(STACK).txt
	$(PY) -m pip install --no-deps --find-links $(WHEELS) -r requirements/stack-$(STACK)-nodeps.txt
	$(PLATFORM_PASS)
	{ if [ -f $(LOCK) ]; then grep '^#' $(LOCK); else echo "# Exact versions of everything in $(VENV) (generated by \`make lock STACK=$(STACK)\`)."; fi; \
	  $(PY) -m pip freeze --all --exclude-editable --exclude pip $(foreach p,$(PLATFORM_PKGS),--exclude $(p)); } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

clean:
	rm -rf $(VENV)
