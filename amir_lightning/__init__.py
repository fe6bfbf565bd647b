"""amir-lightning: GRPO-family RL post-training of LLMs on PyTorch Lightning, with the AMIR-GRPO pair term.

Importing the package never imports vLLM; only ``amir_lightning.engines.vllm`` does.
"""

__version__ = "0.1.0"
