# Two commands matter: `make run` (the app on the embedded default pair) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test test-slow test-fast lint mutants chaos loadtest scaleout screenshots footer-speedup long-chat prepare bench \
	bench-peers ceiling llama-cpp paper quality chromium clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@start=$$(date +%s) && $(PYTHON) -m venv $(VENV) \
		&& $(PY) -m pip install --disable-pip-version-check --progress-bar on -r requirements-dev.txt \
		&& echo "[setup] installed in $$(( $$(date +%s) - start )) s"
	touch $@

prepare: setup
	$(PY) -m engine.prepare $(ARGS)

run: setup
	$(PY) app.py $(ARGS)

chromium:
	@command -v /usr/bin/chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# What guards behaviour, in minutes: lint, types, architecture contracts, the tiny-model suites
# (two at a time, a test file per worker), the browser and cluster tests on the tiny pair, then a
# short check of the real default pair (answers capped) alone: its engines time the machine at
# start and keep the figures the app reads back.
test: setup lint chromium prepare
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not real" --durations=10
	$(PY) -m pytest -q -m "real and not slow" --durations=5

# The slower guards, opt-in (marked `slow`): fresh installs (a Space's and `pip install .`) and
# the longest prompt on the real pair.
test-slow: setup chromium prepare
	$(PY) -m pytest -q -m slow

# Tiny models only (no real pair, no browser, no Ray cluster, nothing slow).
test-fast: setup
	$(PY) -m pytest -q -m "not real and not browser and not cluster and not slow"

# ruff (lint and format), mypy and the import-linter contracts, all configured in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Normal and misbehaving users at once against the app on the default pair (loopback, bounded).
chaos: setup prepare
	$(PY) -m benchmarks.chaos --json bench-results/chaos.json --table bench-results/chaos.md $(ARGS)

# 1, 2, 4 and 8 users chatting at once through the app on the default pair (loopback, bounded).
loadtest: setup prepare
	$(PY) -m benchmarks.loadtest $(ARGS)

# The app on a two-node Ray cluster on this machine (loopback): 1 then 2 engine replicas, 8 users,
# one replica killed mid-run.
scaleout: setup prepare
	$(PY) -m benchmarks.scaleout $(ARGS)

# The README's screenshots (assets/*.png) of the app on the default pair, taken in Chromium.
screenshots: setup chromium prepare
	$(PY) -m benchmarks.screenshots $(ARGS)

# The speedup a chat answer's footer shows beside the one Compare measures, through the app's API.
footer-speedup: setup prepare
	$(PY) -m benchmarks.footer_speedup $(ARGS)

# Twelve turns past a shared link's input cap (--public-limits) through the API, ar and best:
# every turn answers, each answer after a cut is its window's own (engine.core.window).
long-chat: setup prepare
	$(PY) -m benchmarks.long_chat $(ARGS)

# One-line mutations of the engine, each run against the fast suite: fails if any survives.
mutants: setup
	$(PY) -m tests.mutants $(ARGS)

bench: setup
	$(PY) -m benchmarks.bench --prompts assets/prompts/coding.jsonl --max-new-tokens 128 --k 3,4,5 \
		--modes ar,sd,hybrid,best,genai-ar,genai-sd --json bench-results/coding.json --table bench-results/coding.md $(ARGS)

# Our modes against both peers on the same models: openvino-genai (same IRs) and plain
# llama.cpp (same GGUF files; built from source on first use, about 5 min on 2 cores).
bench-peers: setup llama-cpp
	$(PY) -m benchmarks.bench --prompts assets/prompts/coding.jsonl --max-new-tokens 128 --k 3,5 \
		--modes ar,sd,best,genai-ar,genai-sd,llamacpp,llamacpp-sd --json bench-results/peers.json \
		--table bench-results/peers.md $(ARGS)

llama-cpp: setup
	$(PY) -m benchmarks.llamacpp

# What no exact drafter can beat with this pair on this machine (docs/benchmarks.md, "The ceiling").
ceiling: setup
	$(PY) -m benchmarks.ceiling --prompts assets/prompts/coding.jsonl --max-new-tokens 128 $(ARGS)

paper: setup
	$(PY) -m benchmarks.paper $(ARGS)

# How faithful the target is to the model in its file: agreement, perplexity (llama-perplexity as
# the cross-check) and HumanEval problems solved beside plain llama.cpp on the same GGUF.
quality: setup llama-cpp prepare
	$(PY) -m benchmarks.fidelity --llamacpp --json bench-results/fidelity.json --table bench-results/fidelity.md $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache bench-results
