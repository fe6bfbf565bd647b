"""Which task can the bundled SmolLM2 learn from, with completions as long as possible? Measured before training.

    python benchmarks/task_screen.py [--prompts 48] [--samples 8]

GRPO learns only from groups whose rewards differ. For each candidate task (template, operands, length limit) this
samples ``--prompts`` training prompts x ``--samples`` completions from the untrained model with vLLM at the
training temperature (0.7), grades them with ``MathAnswerReward`` (last number, or ``\\boxed{}``), and prints:
accuracy, mean completion length (all, correct, wrong), the share cut at the length limit, and the share of groups
with reward variance. The rule is to take the longest task where at least half the groups vary (docs/science.md,
experiment 2).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
from _common import machine  # noqa: E402

from amir_lightning.data import ArithmeticPrompts, render_prompt  # noqa: E402
from amir_lightning.engines import SamplingConfig, VLLMEngine  # noqa: E402
from amir_lightning.models import BundledSmolLM2  # noqa: E402
from amir_lightning.rewards import MathAnswerReward  # noqa: E402

#: name -> (template, terms, largest operand, max new tokens)
CANDIDATES = {
    "sum 0-12, just the number": ("What is {expression}? Answer with just the number.", 2, 12, 32),
    "sum 0-12, free answer": ("What is {expression}?", 2, 12, 128),
    "sum 0-12, explain": ("What is {expression}? Explain your answer briefly.", 2, 12, 128),
    "sum 0-12, step by step": ("What is {expression}? Think step by step.", 2, 12, 160),
    "sum 0-9, step by step": ("What is {expression}? Think step by step.", 2, 9, 160),
    "3 digits, free answer": ("What is {expression}?", 3, 9, 128),
    "3 digits, step by step": ("What is {expression}? Think step by step.", 3, 9, 192),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--only", nargs="*", default=None, help="candidate names (default: all)")
    args = parser.parse_args()
    model_dir = BundledSmolLM2().resolve()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(max_model_len=512, kv_cache_memory_bytes=512 * 1024**2, progress=False)
    engine.start(model_dir, seed=0)
    grader = MathAnswerReward()
    print(f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.samples}, T {args.temperature}, {machine()}")
    print("| task | max tokens | accuracy | length | correct | wrong | cut at limit | groups with variance |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (template, terms, top, max_new) in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        source = ArithmeticPrompts(num_terms=terms, max_value=top, template=template, heldout_fraction=0.45)
        prompts = [source[i] for i in range(args.prompts)]
        ids = [render_prompt(tokenizer, p) for p in prompts]
        sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=max_new)
        groups = engine.generate(ids, args.samples, sampling)
        texts = [c.text for g in groups for c in g]
        answers = [p.answer for p, g in zip(prompts, groups) for _ in g]
        correct = np.array(grader.correctness(texts, answers)).reshape(len(prompts), args.samples)
        lengths = np.array([len(c.token_ids) for g in groups for c in g]).reshape(correct.shape)
        cut = np.mean([c.finish_reason == "length" for g in groups for c in g])
        varied = np.mean(correct.std(axis=1) > 0)
        right = lengths[correct == 1].mean() if correct.any() else float("nan")
        wrong = lengths[correct == 0].mean() if (correct == 0).any() else float("nan")
        print(
            f"| {name} | {max_new} | {correct.mean():.3f} | {lengths.mean():.1f} | {right:.1f} | {wrong:.1f} | "
            f"{cut:.1%} | {varied:.0%} |",
            flush=True,
        )
    grader.close()


if __name__ == "__main__":
    main()
