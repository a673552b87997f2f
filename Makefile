# `make demo` and `make test` work on a fresh clone: they create a venv with Python 3.12 and install the
# pinned Megatron stack (first run: a few minutes, ~6 GB; later runs reuse the venv).
#
# STACK picks the exact lock, requirements/lock-$(STACK).txt, each in its own venv:
#   26.02            megatron-bridge 0.3.1 + megatron-core 0.16.1 + emerging-optimizers 0.3.0 (.venv)
#   26.02-container  what the NeMo 26.02 container ships: megatron-bridge 0.3.0, megatron-core 0.16.0,
#                    emerging-optimizers 0.1.0, NeMo-Run 0.8.0, PyTorch 2.10 (.venv-26.02-container)
SHELL := /bin/bash
STACK ?= 26.02
STACKS := 26.02 26.02-container
VENV ?= $(if $(filter 26.02,$(STACK)),.venv,.venv-$(STACK))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(STACK)
LOCK := requirements/lock-$(STACK).txt
# Wheels that are not on the package index (emerging-optimizers 0.1.0); see requirements/wheels/README.md.
WHEELS := requirements/wheels

# A working Python 3.12: $PYTHON, python3.12 on PATH, or a pyenv / system install.
PY312_CHECK := -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'
ifndef PYTHON
PYTHON := $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) /usr/bin/python3.12 /usr/local/bin/python3.12,$(shell $(p) $(PY312_CHECK) >/dev/null 2>&1 && echo $(p))))
endif

.PHONY: install demo test test-fast generate yaml lock clean check-stack check-wheels

check-stack:
	@[ -f $(LOCK) ] || { echo "error: unknown STACK=$(STACK); choose one of: $(STACKS)"; exit 2; }

# Every wheel the lock takes from $(WHEELS) must be there with the recorded checksum.
check-wheels: check-stack
	@grep -v '^#' requirements/wheels/SHA256SUMS | while read -r sum file; do \
	  if ! grep -qi "^$$(echo $$file | cut -d- -f1 | tr _ -)==$$(echo $$file | cut -d- -f2)\b" $(LOCK); then continue; fi; \
	  if [ ! -f "$(WHEELS)/$$file" ]; then \
	    echo "error: $(WHEELS)/$$file is missing. Build it from the v$$(echo $$file | cut -d- -f2) tag of" \
	         "NVIDIA-NeMo/Emerging-Optimizers (pip wheel --no-deps .) and put it there"; exit 2; fi; \
	  echo "$$sum  $(WHEELS)/$$file" | sha256sum --check --status || { \
	    echo "error: $(WHEELS)/$$file does not match its SHA256SUMS entry; replace it with the upstream build"; exit 2; }; \
	done

install: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml | check-wheels
	@if [ ! -x $(PY) ]; then \
	  if [ -z "$(PYTHON)" ]; then \
	    echo "error: no Python 3.12 found. Install one (pyenv install 3.12, or apt install python3.12)" \
	         "or pass PYTHON=/path/to/python3.12"; exit 2; fi; \
	  echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV) || exit 2; fi
	@$(PY) $(PY312_CHECK) || { echo "error: $(VENV) is not Python 3.12; remove it (make clean) and retry"; exit 2; }
	$(PY) -m pip install --no-deps --find-links $(WHEELS) -r $(LOCK)
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

DEMO_RUN ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

# Trains the Kimi K2 proxy (MLA + MoE, MuonClip) with Muon on CPU on real text (~1 minute), then prints
# where the checkpoint, the TensorBoard log and the loss curve are. The full recipe's validated config:
# `nemo llm pretrain --recipe kimi_k2_muon --dryrun`.
demo: install
	$(VENV)/bin/nemo llm pretrain --recipe kimi_k2_proxy_muon checkpoint.save=$(DEMO_RUN)/checkpoints \
	  checkpoint.load=$(DEMO_RUN)/checkpoints logger.tensorboard_dir=$(DEMO_RUN)/tb_logs

# PYTEST_ARGS narrows a run, e.g. PYTEST_ARGS='-m "(stack or not slow) and not once and not heavy"' (.ci/run's second stack).
test: install
	$(PY) -m pytest -n 2 --durations=15 $(PYTEST_ARGS)

test-fast: install  # everything but the tests marked slow
	$(PY) -m pytest -n 2 -m "not slow"

generate: install  # regenerate yaml/<recipe>.yaml and docs/recipes.md from the Python recipes
	$(PY) -m bridge_ext.generate

yaml: generate

lock: install  # re-resolve the curated lists and rewrite the lock (needs network)
	$(PY) -m pip install -r requirements/stack-$(STACK).txt
	$(PY) -m pip install --no-deps --find-links $(WHEELS) -r requirements/stack-$(STACK)-nodeps.txt
	{ grep '^#' $(LOCK); $(PY) -m pip freeze --all --exclude-editable --exclude pip; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV)
