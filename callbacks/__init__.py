"""Read-only training monitors, installed as ``amir_lightning.callbacks``; training is identical without them."""

from amir_lightning.callbacks.length_bias import LengthBiasMonitor
from amir_lightning.callbacks.pair_margin import PairMarginMonitor
from amir_lightning.callbacks.samples import RolloutSampleLogger
from amir_lightning.callbacks.throughput import ThroughputMonitor
from amir_lightning.systems.progress import RunProgressBar

__all__ = ["LengthBiasMonitor", "PairMarginMonitor", "RolloutSampleLogger", "RunProgressBar", "ThroughputMonitor"]
