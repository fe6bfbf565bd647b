"""One vLLM server against two replicas on the same CPU cores: generation tokens/s, wall per rollout, and the push.

    python benchmarks/replicas.py [--cores 0,1] [--rollouts 3] [--prompts 16] [--group 8] [--tokens 64]

The bundled SmolLM2-135M, served by ``VLLMServerEngine`` (float32, CPU) in two layouts over the same cores: one server
with a thread per core (``cpu_cores: "0,1"``, ``threads: 2``), and ``replicas: 2``, each pinned to one core with one
thread (``cpu_cores: ["0", "1"]``). A rollout is ``--prompts`` prompts of ``--group`` samples each, up to ``--tokens``
tokens (the EOS ignored, so both layouts write the same number); its groups go whole to a replica
(``engines/replicas.py``). Before the rollouts, and between them, the policy is pushed (gloo) and verified exactly on
every replica by the run's own ``SyncCheck``: the table gives the tensors it read back and the push's seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import machine


def measure(layout: str, cores: list[str], rollouts: int, prompts: int, group: int, tokens: int) -> dict:
    """Start the layout's engine, push and verify, then time ``rollouts`` rollouts (a push and check between)."""
    from amir_lightning.engines import SamplingConfig, VLLMServerEngine
    from amir_lightning.loop.sync import SyncCheck
    from amir_lightning.models import HFModel
    from amir_lightning.models.bundled import materialize_smollm2
    from amir_lightning.models.policy import Policy

    path = materialize_smollm2()
    settings = {"max_model_len": 256, "kv_cache_memory_bytes": 128 * 2**20, "max_num_seqs": prompts * group}
    if layout == "one server":
        engine = VLLMServerEngine(**settings, cpu_cores=",".join(cores), threads=len(cores))
    else:
        engine = VLLMServerEngine(**settings, cpu_cores=cores, threads=1, replicas=len(cores))
    policy = Policy(HFModel(str(path)))
    policy.build(torch.float32)
    check = SyncCheck()
    check.set_probe(policy.tokenizer, policy.tokenizer("12+4=")["input_ids"], "16 = 12 + 4")
    engine.start(path, seed=0)
    try:
        sampling = SamplingConfig(max_new_tokens=tokens, generation_kwargs={"ignore_eos": True})
        ids = [policy.tokenizer(f"Question {i}: what is {i} + {2 * i}?")["input_ids"] for i in range(prompts)]
        walls, written, pushes, verified, copies = [], 0, [], 0, 0
        for rollout in range(rollouts + 1):
            with torch.no_grad():
                next(policy.model.parameters()).add_(1e-3)  # a new version at each push
            start = time.perf_counter()
            report = check.push_and_verify(policy, engine, version=rollout + 1)
            pushes.append(time.perf_counter() - start)
            verified, copies = report.verified, report.copies
            start = time.perf_counter()
            groups = engine.generate(ids, group, sampling, seed=rollout)
            wall = time.perf_counter() - start
            if rollout:  # the first warms the servers
                walls.append(wall)
                written += sum(len(c.token_ids) for g in groups for c in g)
        return {
            "tokens_per_s": written / sum(walls),
            "wall": statistics.median(walls),
            "push": statistics.median(pushes[1:]),
            "verified": verified,
            "copies": copies,
        }
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", default="0,1", help="the CPU cores both layouts share")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    cores = args.cores.split(",")
    print(machine())
    print(f"SmolLM2-135M, float32; a rollout: {args.prompts} prompts x {args.group} samples x {args.tokens} tokens")
    print("| layout | cores | generation tokens/s | wall per rollout (s, median) | push + check (s) | "
          "tensors verified per sync | copies verified |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for layout in ("one server", f"{len(cores)} replicas"):
        got = measure(layout, cores, args.rollouts, args.prompts, args.group, args.tokens)
        print(f"| {layout} | {args.cores} | {got['tokens_per_s']:.0f} | {got['wall']:.2f} | {got['push']:.2f} | "
              f"{got['verified']} | {got['copies']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
