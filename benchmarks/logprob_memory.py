"""Peak memory and time of the log-prob path (forward and backward) with a Qwen2.5-sized vocabulary, fused or not.

    python benchmarks/logprob_memory.py [--rows 8] [--completion 512] [--prompt 32] [--vocab 151936] [--hidden 128]

A random Qwen2 model (Qwen2.5's 151,936-token vocabulary, a small decoder so the head dominates) scores
``--rows`` x ``--completion`` completion tokens after ``--prompt``-token prompts, and backpropagates through the
log-probs, as a training micro-batch does. Each path runs in a fresh process: the memory figure is the growth of
the process's peak resident memory over the step (the model and batch are built before), the time the median of
three steps after a first one.
- materialised: the completion positions' ``[n, T, V]`` logits, log-softmax ``model.scoring.chunk_size`` tokens of
  rows at a time (what TRL and the official code do, and this package did before);
- fused: ``chosen_token_logps``, the LM head and the log-softmax in chunks, recomputed in the backward.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(args) -> dict:
    import tempfile

    import torch

    from amir_lightning.models import build_tiny_model
    from amir_lightning.models.scoring import completion_logps

    # glibc's default malloc maps every allocation above 32 MiB on its own and unmaps it when freed, so the peak
    # resident memory follows the live tensors (the other benchmarks' steady_malloc would keep freed chunks).
    torch.manual_seed(0)
    directory = build_tiny_model(
        tempfile.mkdtemp() + "/model", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=2, num_heads=4,
        num_kv_heads=2, seed=0, max_position_embeddings=args.prompt + args.completion,
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    length = args.prompt + args.completion
    ids = torch.randint(0, args.vocab, (args.rows, length))
    mask = torch.ones_like(ids)

    def step() -> float:
        start = time.perf_counter()
        logps, _ = completion_logps(model, ids, mask, args.completion, 1.0, args.chunk, fused=args.path == "fused")
        logps.sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    before = rss_mib()
    seconds = [step() for _ in range(4)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"path": args.path, "peak_growth_mib": peak - before, "seconds": sorted(seconds[1:])[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=512, help="model.scoring.chunk_size")
    parser.add_argument("--path", choices=["fused", "materialised"], default=None, help="(internal) one path")
    args = parser.parse_args()
    if args.path:
        print(json.dumps(measure(args)))
        return
    import torch

    results = []
    for path in ("materialised", "fused"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--path", path], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    tokens = args.rows * args.completion
    print(
        f"log-probs + backward of {args.rows} x {args.completion} completion tokens, vocabulary {args.vocab}, hidden "
        f"{args.hidden}, chunk {args.chunk} tokens, torch {torch.__version__}, {os.cpu_count()} cores"
    )
    print("| path | peak memory growth MiB | s per step | tokens/s |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['peak_growth_mib']:.0f} | {r['seconds']:.2f} | {tokens / r['seconds']:.0f} |")
    ratio = results[0]["peak_growth_mib"] / max(results[1]["peak_growth_mib"], 1e-9)
    print(f"\nmaterialised / fused peak memory: {ratio:.1f}x")


if __name__ == "__main__":
    main()
