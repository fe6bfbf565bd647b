"""Three in-process vLLM engines in turn: the first left unclosed in a reference cycle, the second closed, the third
started after both. Each prints ``generated`` once it has generated. Run by
``tests/test_engine_numerics.py::test_an_engine_left_unclosed_does_not_take_the_next_engines_parallel_state``.

    python tests/helpers/unclosed_engine.py MODEL_DIR
"""

import gc
import os
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

# Imported before any engine starts: imported inside the first start, vLLM's lazy imports keep a reference to that
# start's frame, and so to the first engine, which is then never collected (and shows nothing).
import vllm.v1.engine.core  # noqa: E402, F401
from vllm import LLM  # noqa: E402, F401

from amir_lightning.engines import SamplingConfig, VLLMEngine  # noqa: E402


def started(model_dir: str) -> VLLMEngine:
    engine = VLLMEngine(max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False)
    engine.start(model_dir, seed=0)
    if len(engine.generate([[1, 2, 3]], n=2, sampling=SamplingConfig(max_new_tokens=4))[0]) == 2:
        print("generated", flush=True)
    return engine


def main(model_dir: str) -> None:
    left = started(model_dir)
    left.llm.cycle = left.llm  # what a finished run leaves: reachable from nothing, collected whenever
    del left
    gc.unfreeze()  # as any engine's shutdown does: the heap vLLM froze at start-up becomes collectable
    # The collector runs when allocations say so: before the next engine's groups exist (harmless) or after. Only
    # explicit collections now, the model loader's among them (after).
    gc.disable()
    started(model_dir).close()
    gc.enable()
    started(model_dir).close()  # a closed engine was shut down at close, not at some later collection


if __name__ == "__main__":
    main(sys.argv[1])
