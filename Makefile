# Two commands matter: `make run` (the app on the embedded default pair) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test test-fast lint mutants chaos loadtest scaleout prepare bench bench-peers ceiling llama-cpp paper report chromium clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

prepare: setup
	$(PY) -m engine.prepare $(ARGS)

run: setup
	$(PY) app.py $(ARGS)

chromium:
	@command -v /usr/bin/chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# Everything: lint, types, architecture contracts, tiny-model suite, browser test, and the
# smoke test on the real default pair.
test: setup lint chromium prepare
	$(PY) -m pytest -q

# Tiny models only (no real pair, no browser, no fresh install).
test-fast: setup
	$(PY) -m pytest -q -m "not real and not browser and not install and not cluster"

# ruff (lint and format), mypy and the import-linter contracts, all configured in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Normal and misbehaving users at once against the app on the default pair (loopback, bounded).
chaos: setup prepare
	$(PY) -m engine.tools.chaos --json bench-results/chaos.json --table bench-results/chaos.md $(ARGS)

# 1, 2, 4 and 8 users chatting at once through the app on the default pair (loopback, bounded).
loadtest: setup prepare
	$(PY) -m engine.tools.loadtest $(ARGS)

# The app on a two-node Ray cluster on this machine (loopback): 1 then 2 engine replicas, 8 users,
# one replica killed mid-run.
scaleout: setup prepare
	$(PY) -m engine.tools.scaleout $(ARGS)

# One-line mutations of the engine, each run against the fast suite: fails if any survives.
mutants: setup
	$(PY) -m tests.mutants $(ARGS)

bench: setup
	$(PY) -m engine.tools.bench --prompts assets/prompts/coding.jsonl --max-new-tokens 128 --k 3,4,5 \
		--modes ar,sd,hybrid,best,genai-ar,genai-sd --json bench-results/coding.json --table bench-results/coding.md $(ARGS)

# Our modes against both peers on the same models: openvino-genai (same IRs) and plain
# llama.cpp (same GGUF files; built from source on first use, about 5 min on 2 cores).
bench-peers: setup llama-cpp
	$(PY) -m engine.tools.bench --prompts assets/prompts/coding.jsonl --max-new-tokens 128 --k 3,5 \
		--modes ar,sd,best,genai-ar,genai-sd,llamacpp,llamacpp-sd --json bench-results/peers.json \
		--table bench-results/peers.md $(ARGS)

llama-cpp: setup
	$(PY) -m engine.tools.llamacpp

# What no exact drafter can beat with this pair on this machine (docs/benchmarks.md, "The ceiling").
ceiling: setup
	$(PY) -m engine.tools.ceiling --prompts assets/prompts/coding.jsonl --max-new-tokens 128 $(ARGS)

paper: setup
	$(PY) -m engine.tools.paper $(ARGS)

report: setup
	$(PY) -m engine.tools.quant_report $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache bench-results
