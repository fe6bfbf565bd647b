"""Benchmark results: unbiased pass@k per benchmark, per-sample margins under the policy, and a JSON per benchmark."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from amir_lightning.evaluation.passk import PassAtK
from amir_lightning.loop.batch import batch_logps, make_batch
from amir_lightning.models.policy import Policy
from amir_lightning.objectives import sequence_logps


@torch.no_grad()
def sample_logps(policy: Policy, groups, chunk_groups: int = 1) -> torch.Tensor:
    """``[P, n]`` mean token log-prob (temperature 1) of every evaluation sample under the policy.

    One group per forward by default: the logits of a chunk are ``[rows, T, vocabulary]`` floats.
    """
    out = []
    for start in range(0, len(groups), chunk_groups):
        chunk = groups[start : start + chunk_groups]
        batch = make_batch(chunk, policy.pad_token_id)
        logps = batch_logps(policy, batch, temperature=1.0)
        out.append(sequence_logps(logps, batch.completion_mask, "mean").view(len(chunk), -1))
    return torch.cat(out)


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def benchmark_report(
    policy: Policy, batch: dict, ks: list[int], out_dir: Path | None, score_with: str = "engine"
) -> dict[str, torch.Tensor]:
    """pass@k of one evaluation batch, written with per-problem details to ``out_dir/<benchmark>.json``.

    ``out_dir`` ``None``: nothing is written (the processes other than the global zero).
    ``mean_logp`` per sample comes from the engine (``score_with="engine"``: sampling log-probs at the evaluation
    temperature) or from the policy at temperature 1 (``"policy"``).
    """
    name, correct = batch["benchmark"], batch["correct"]
    samples = correct.shape[1]
    metric = PassAtK(ks)
    metric.update(correct.sum(1), samples)
    passk = {k: float(v) for k, v in metric.compute().items()}
    if score_with == "policy":  # a forward over every sample: exact, as costly as generating them
        margins = sample_logps(policy, batch["groups"])  # [P, n]
    else:  # the engine's own log-probs of the samples, free, at the evaluation temperature
        margins = torch.tensor(
            [[sum(c.sampling_logps) / max(len(c.sampling_logps), 1) for c in g.completions] for g in batch["groups"]]
        )  # [P, n]
    if out_dir is not None:
        problems = [
            {
                "index": i,
                "question": g.question,
                "answer": g.answer,
                "correct": [int(c) for c in correct[i].tolist()],
                "lengths": [int(x) for x in batch["lengths"][i].tolist()],
                "mean_logp": [round(float(x), 6) for x in margins[i].tolist()],
            }
            for i, g in enumerate(batch["groups"])
        ]
        payload = {
            "benchmark": name,
            "samples": samples,
            "temperature": batch["temperature"],
            "logps": score_with,
            "pass@k": {str(k): v for k, v in passk.items()},
            "problems": problems,
        }
        write_json(out_dir / f"{name}.json", payload)
    logged = {f"eval/{name}/pass@{k}": torch.tensor(v) for k, v in passk.items()}
    logged[f"eval/{name}/problems"] = torch.tensor(float(correct.shape[0]))
    return logged
