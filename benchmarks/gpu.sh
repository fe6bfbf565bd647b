#!/usr/bin/env bash
# The GPU checks: the gpu-marked tests and the paper-shape training step, on one CUDA machine.
#
#   bash benchmarks/gpu.sh wheels   # where PyPI is reachable: the pure-Python wheels a bare CUDA image lacks,
#                                   # into .gpu-wheels/ (bring that folder along with the working tree)
#   bash benchmarks/gpu.sh run      # on the GPU machine, offline: install them aside, run the checks
#   bash benchmarks/gpu.sh tests    # the same, the gpu-marked tests alone
#
# The target image has torch, lightning, transformers, peft, tensorboard and torchmetrics, but no vLLM and no hub
# (docs/gpu.md): the tests use HFEngine and random models built from a config, one of Qwen2.5-3B's shape.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$ROOT/.gpu-wheels
PY=${PYTHON:-python3}

case "${1:-run}" in
wheels)
    # Pure Python, so any interpreter version and platform take them.
    $PY -m pip download --no-deps --only-binary=:all: -d "$WHEELS" \
        'jsonargparse[signatures]==4.53.0' docstring-parser typeshed-client importlib-resources \
        math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2 pytest pluggy iniconfig
    ;;
run | tests)
    STAGE=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" "$WHEELS"/*.whl
    # The installed layout without installing: callbacks/ is the package amir_lightning.callbacks (pyproject.toml).
    mkdir -p "$STAGE/pkg" "$STAGE/work"
    cp -r "$ROOT/amir_lightning" "$STAGE/pkg/" && cp -r "$ROOT/callbacks" "$STAGE/pkg/amir_lightning/callbacks"
    export PYTHONPATH=$STAGE/pkg:$STAGE/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    cd "$STAGE/work"  # not the checkout: `python -m` puts the working directory first on sys.path
    $PY -c "import torch, lightning, transformers, peft; print(torch.__version__, lightning.__version__,
transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
    status=0
    $PY -m pytest -p no:cacheprovider -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -m gpu "$ROOT/tests/gpu" -v || status=1
    [ "$1" = tests ] && exit $status
    # The official re-forward costs ~45 s a step at this shape: time it separately, without --skip-official.
    $PY "$ROOT/benchmarks/step_time.py" --paper-shape --skip-official --repeats 5 "${@:2}" || status=1
    # Less padding and no recomputation: packed rows through PyTorch's varlen flash kernel, with and without
    # gradient checkpointing (peak memory decides qwen.yaml's gradient_checkpointing).
    $PY "$ROOT/benchmarks/step_time.py" --paper-shape --skip-official --repeats 5 --packing --attn varlen || status=1
    $PY "$ROOT/benchmarks/step_time.py" --paper-shape --skip-official --repeats 5 --packing --attn varlen \
        --no-checkpointing || status=1
    exit $status
    ;;
*)
    echo "usage: bash benchmarks/gpu.sh wheels|tests|run [step_time.py options]" >&2
    exit 2
    ;;
esac
