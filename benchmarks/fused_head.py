"""Which LM heads the fused log-prob path takes, and what fusing the others would cost.

    python benchmarks/fused_head.py

For tiny random models of each architecture with a scaled or capped head (the configurations of tests/test_heads.py,
plus Qwen2 as the plain case): the configuration key that refuses fusing, the largest relative difference between
``decoder output @ W.T`` and the model's own logits on a short sequence, the largest absolute log-prob difference
that would make, and the path the trainer takes (``models/scoring.py``: ``fused_head``, ``head_matches_logits``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from test_heads import SCALED, save_tiny  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from amir_lightning.models import HFModel  # noqa: E402
from amir_lightning.models.scoring import head_matches_logits, scaled_head_keys  # noqa: E402
from amir_lightning.systems.module import AmirGRPOModule  # noqa: E402


def main() -> None:
    cases = {**SCALED, "qwen2 (plain head)": (Qwen2Config, {}, "")}
    print("| architecture | key that refuses fusing | logit difference (relative) | max abs log-prob difference "
          "if fused | trainer's path |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, (config_cls, extra, _) in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            module = AmirGRPOModule(policy=HFModel(str(save_tiny(Path(tmp), config_cls, extra))))
            module.configure_model()
            _, relative, logps = head_matches_logits(module.model)
            keys = ", ".join(scaled_head_keys(module.model.config)) or "none"
            path = "fused" if module.policy.fused else "materialised (fallen back)"
            print(f"| {name} | {keys} | {relative:.3g} | {logps:.3g} | {path} |")


if __name__ == "__main__":
    main()
