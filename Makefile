PY ?= .venv/bin/python
# The CPU wheel of torch lies on the CI machines' disk; installing it first keeps pip from
# choosing a multi-GB CUDA build to satisfy the `torch>=2.6` range.
TORCH_CPU ?= torch==2.13.0
# The pyproject extras `make setup` installs (comma-separated), kept in one place.
EXTRAS ?= dev,trl
# Made by the last successful set-up; older than pyproject.toml means the environment is stale.
VENV := .venv/.patchgen-setup

.PHONY: setup test generate check lint bench demo

# Every target that runs the project depends on the environment: on a fresh clone the first
# `make test` or `make demo` makes it, later ones reuse it (`rm $(VENV)` forces a new set-up).
setup: $(VENV)

$(VENV): pyproject.toml
	python3 -m venv .venv && $(PY) -m pip install -q $(TORCH_CPU) && $(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

test: $(VENV)
	$(PY) -m pytest -q

generate: $(VENV)
	.venv/bin/patchgen --all

check: $(VENV)
	.venv/bin/patchgen --check

lint: $(VENV)
	.venv/bin/ruff check patchgen kernels tests bench examples

bench: $(VENV)
	$(PY) bench/generator_time.py

demo: $(VENV)
	$(PY) -m patchgen.kernels.modeling.demo
