"""Evaluation: the paper's benchmarks, unbiased pass@k, per-benchmark reports, and run comparison."""

from amir_lightning.evaluation.benchmarks import PRESETS, BenchmarkPrompts
from amir_lightning.evaluation.passk import PassAtK, pass_at_k

__all__ = ["PRESETS", "BenchmarkPrompts", "PassAtK", "pass_at_k"]
