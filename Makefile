PY ?= .venv/bin/python
# The CPU wheel of torch lies on the CI machines' disk; installing it first keeps pip from
# choosing a multi-GB CUDA build to satisfy the `torch>=2.6` range.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test generate check lint bench demo

setup:
	python3 -m venv .venv && $(PY) -m pip install -q $(TORCH_CPU) && $(PY) -m pip install -q -e '.[dev,trl]'

test:
	$(PY) -m pytest -q

generate:
	.venv/bin/patchgen --all

check:
	.venv/bin/patchgen --check

lint:
	.venv/bin/ruff check patchgen kernels tests bench

bench:
	$(PY) bench/generator_time.py

demo:
	$(PY) -m patchgen.kernels.modeling.demo
