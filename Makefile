# `make demo` and `make test` work on a fresh clone: they create .venv with Python 3.12 and install the
# pinned Megatron stack (first run: a few minutes, ~6 GB; later runs reuse .venv).
SHELL := /bin/bash
STACK ?= 26.02
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(STACK)

# A working Python 3.12: $PYTHON, python3.12 on PATH, or a pyenv / system install.
PY312_CHECK := -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'
ifndef PYTHON
PYTHON := $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) /usr/bin/python3.12 /usr/local/bin/python3.12,$(shell $(p) $(PY312_CHECK) >/dev/null 2>&1 && echo $(p))))
endif

.PHONY: install demo test test-fast generate yaml lock clean

install: $(STAMP)

$(STAMP): requirements/lock-$(STACK).txt pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if [ -z "$(PYTHON)" ]; then \
	    echo "error: no Python 3.12 found. Install one (pyenv install 3.12, or apt install python3.12)" \
	         "or pass PYTHON=/path/to/python3.12"; exit 2; fi; \
	  echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV) || exit 2; fi
	@$(PY) $(PY312_CHECK) || { echo "error: $(VENV) is not Python 3.12; remove it (make clean) and retry"; exit 2; }
	$(PY) -m pip install --no-deps -r requirements/lock-$(STACK).txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	@touch $@

DEMO_RUN ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

# Trains the Kimi K2 proxy (MLA + MoE, MuonClip) with Muon on CPU on real text (~1 minute), then prints
# where the checkpoint, the TensorBoard log and the loss curve are. The full recipe's validated config:
# `nemo llm pretrain --recipe kimi_k2_muon --dryrun`.
demo: install
	$(VENV)/bin/nemo llm pretrain --recipe kimi_k2_proxy_muon checkpoint.save=$(DEMO_RUN)/checkpoints \
	  checkpoint.load=$(DEMO_RUN)/checkpoints logger.tensorboard_dir=$(DEMO_RUN)/tb_logs

test: install
	$(PY) -m pytest -n 2 --durations=15

test-fast: install  # everything but the tests marked slow
	$(PY) -m pytest -n 2 -m "not slow"

generate: install  # regenerate yaml/<recipe>.yaml and docs/recipes.md from the Python recipes
	$(PY) -m bridge_ext.generate

yaml: generate

lock: install  # re-resolve the curated lists and rewrite the lock (needs network)
	$(PY) -m pip install -r requirements/stack-$(STACK).txt
	$(PY) -m pip install --no-deps -r requirements/stack-$(STACK)-nodeps.txt
	{ sed -n '1,2p' requirements/lock-$(STACK).txt; $(PY) -m pip freeze --all --exclude-editable --exclude pip; } > requirements/lock-$(STACK).txt.new
	mv requirements/lock-$(STACK).txt.new requirements/lock-$(STACK).txt

clean:
	rm -rf $(VENV)
