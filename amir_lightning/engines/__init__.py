"""Engines: what samples completions and takes the policy's weights. One seam, ``RolloutEngine`` (``base.py``).

- ``base.py``: the seam, ``SamplingConfig`` and ``Completion``, what every engine returns.
- ``hf.py``: ``HFEngine``, Hugging Face ``generate`` in the training process (tests, GPU checks without vLLM).
- ``vllm.py``: ``VLLMEngine``, vLLM in the training process; ``vllm_worker.py`` is what runs in its workers.
- ``server.py``: ``VLLMServerEngine``, a vLLM server over HTTP that the run starts or is given;
  ``server_setup.py`` its command, folders and routes.
- ``digest.py``, ``shards.py``, ``adapters.py``: how pushed weights are fingerprinted and read back, tensor by tensor
  and shard by shard, and how LoRA adapters are pushed.

An engine imports nothing from the loop, the environments or the systems. ``VLLMEngine`` is importable without vLLM
installed (it raises a clear error when started); ``VLLMServerEngine`` never imports vLLM in the training process.
"""

from amir_lightning.engines.base import Completion, RolloutEngine, SamplingConfig
from amir_lightning.engines.hf import HFEngine
from amir_lightning.engines.server import VLLMServerEngine
from amir_lightning.engines.vllm import VLLMEngine

__all__ = ["Completion", "HFEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine", "VLLMServerEngine"]
