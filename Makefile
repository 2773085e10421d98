# The two commands of the README: `make demo` (set up + serve SmolLM2) and `make test`.
PY := .venv/bin/python
export SGLANG_HF_BACKEND_CACHE ?= $(CURDIR)/.cache

.PHONY: setup demo test

setup:
	scripts/setup.sh

demo: setup
	$(PY) -m sglang_hf_backend.demo

test: setup
	$(PY) -m pytest
