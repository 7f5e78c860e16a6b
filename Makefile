# The two commands of the README: `make train` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
BASE := $(VENV)/.installed
TEST := $(VENV)/.installed-test

.PHONY: train test test-all selfcheck bench install clean

install: $(TEST)

# Reuse a torch that is already importable (system site-packages); otherwise install the tested pin.
# Training needs only the base dependencies; the tests add diffusers, transformers, peft, wandb, ...
# A fresh `make test` installs both in one pip call (one resolve, one build of this package).
define venv_with
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install $(2) -e "$(1)"
endef

$(BASE): pyproject.toml
	$(call venv_with,.)
	touch $(BASE)

# --no-compile: pip byte-compiles every module it installs (28 s of a 72 s install, mostly of modules no test
# imports); the suite's processes cache those they import instead (below)
$(TEST): pyproject.toml
	$(call venv_with,.[test],--no-compile)
	touch $(BASE) $(TEST)

train: $(BASE)
	PYTHON=$(PY) ./train_mmdit_stable.sh $(ARGS)

# Python caches the bytecode of what it imports, even where PYTHONDONTWRITEBYTECODE is set (these machines set it):
# otherwise each of the ~300 Python processes the suite starts would compile every module it imports again.
# `make test`: the suite but the heavier repeats of a check on more families or kernels (the `full` mark: tests/conftest.py
# lists them), 16-18 minutes on 2 cores (its budget is 10); `make test-all`: every test, about 20.
test: $(TEST)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist worksteal -m "not full" $(PYTEST_ARGS)

test-all: $(TEST)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist worksteal $(PYTEST_ARGS)

# Each plugin in a short real run on this machine's GPUs (or CPU): a table of passed / failed / not runnable,
# with step time, images/s, MFU, peak memory and host syncs per step (docs/gpu-check.md).
selfcheck: $(BASE)
	$(PY) benchmarks/selfcheck.py $(ARGS)

# The training step of SD3 / SD3.5 fine-tuning at 1024 px on this machine's GPU, against diffusers' model in the same
# run: a table and benchmarks/train_step_<device>.json (ARGS="--size tiny" checks it on a CPU)
bench: $(TEST)
	$(PY) benchmarks/train_step.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
