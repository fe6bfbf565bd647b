"""How often a model calls the calculator before any training, and how often it is then right (a tool-use task screen).

    python benchmarks/tool_use.py                      # the bundled SmolLM2, two-digit products, 32 prompts x 4
    python benchmarks/tool_use.py --model path/to/hf_dir --prompts 64 --protocol tools

Episodes run as in training (``environments/base.py``, real vLLM), in two protocols. ``text``: ``CalculatorEnvironment``
(``<calc>37*8</calc>``), the calculator described in the system prompt, with a worked example or without.
``tools``: the calculator as a Python function (``ToolEnvironment``), its schema shown by the chat template
(``configs/templates/chatml_tools.jinja``) and calls read by vLLM's ``hermes`` parser, with a worked call as an
earlier turn or without (``configs/demo_tools.yaml``). Per variant the table gives the share of episodes with a
calculator call, the share graded correct, and the mean episode length. RL needs some episodes of each kind in a
group: a model that never calls the tool gives no signal to learn it, and one that always does has nothing left to
learn about calling.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

DESCRIBED = (
    "You can use a calculator. To use it, write <calc>expression</calc>, for example <calc>23*7</calc>; the result "
    "follows as <result>161</result>. Then give the answer."
)
SHORT = "You can use a calculator: write <calc>expression</calc> and the result follows as <result>value</result>."
EXAMPLE = ("What is 23 * 7?", "<calc>23*7</calc><result>161</result> The answer is 161.")
TEMPLATE = Path(__file__).resolve().parents[1] / "configs" / "templates" / "chatml_tools.jinja"
#: A worked call as earlier turns of the conversation: the question, the call, its result, the answer.
TOOL_EXAMPLE = (
    {"role": "user", "content": "What is 23 * 7?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "23*7"}}}]},
    {"role": "tool", "name": "calculator", "content": "161"},
    {"role": "assistant", "content": "The answer is 161."},
)  # fmt: skip
TOOL_VARIANTS = {
    "tools: the schema in the system turn": None,
    "tools: the schema and a worked call as earlier turns (configs/demo_tools.yaml)": TOOL_EXAMPLE,
}
# name -> (system prompt, a worked example given as an earlier user/assistant exchange or None)
VARIANTS = {
    "described": (DESCRIBED, None),
    "example in the system prompt (configs/demo_calculator.yaml)": (
        f"{SHORT}\n\nUser: {EXAMPLE[0]}\nAssistant: {EXAMPLE[1]}",
        None,
    ),
    "example as an earlier chat turn": (SHORT, EXAMPLE),
}


def main() -> None:
    from _common import machine
    from transformers import AutoTokenizer

    from amir_lightning.data import ArithmeticPrompts
    from amir_lightning.data.templates import ChatFormat
    from amir_lightning.engines import SamplingConfig, VLLMEngine
    from amir_lightning.environments import CalculatorEnvironment, ToolEnvironment
    from amir_lightning.environments.base import EpisodeBatch, run_episodes
    from amir_lightning.models import BundledSmolLM2
    from amir_lightning.rewards import MathAnswerReward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face directory (default: the bundled SmolLM2)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--protocol", choices=["text", "tools", "both"], default="both")
    args = parser.parse_args()
    path = Path(args.model) if args.model else BundledSmolLM2().resolve()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(max_model_len=512, kv_cache_memory_bytes=256 * 1024**2, progress=False)
    engine.start(path, seed=0)
    source = ArithmeticPrompts(min_value=10, max_value=99, operators="*", template="What is {expression}?", split="all")
    prompts = [source[i] for i in range(args.prompts)]
    grader = MathAnswerReward()
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=args.max_new_tokens)
    print(f"{path.name}; {args.prompts} two-digit products x {args.samples} episodes, T 0.7; {machine()}\n")
    print("| how the calculator is shown | episodes with a call | correct | mean tokens | seconds |")
    print("|---|---|---|---|---|")
    runs = []  # (name, environment, chat, earlier turns)
    if args.protocol in ("text", "both"):
        for name, (system, example) in VARIANTS.items():
            turns = None
            if example is not None:
                turns = ({"role": "user", "content": example[0]}, {"role": "assistant", "content": example[1]})
            runs.append((name, CalculatorEnvironment(max_turns=3), ChatFormat(system_prompt=system), turns))
    if args.protocol in ("tools", "both"):
        for name, turns in TOOL_VARIANTS.items():
            environment = ToolEnvironment(["amir_lightning.environments.calculator.calculator"], max_turns=3)
            chat = ChatFormat(template=TEMPLATE.read_text(), tools=environment.tool_schemas())
            environment.prepare(tokenizer, chat)
            runs.append((name, environment, chat, turns))
    for name, environment, chat, turns in runs:
        shown = prompts
        if turns is not None:
            shown = [replace(p, messages=(*turns, {"role": "user", "content": p.question})) for p in prompts]
        prompt_ids = [chat.render(tokenizer, p) for p in shown]

        start = time.perf_counter()
        batch = EpisodeBatch(prompts, prompt_ids, args.samples, sampling, engine, 0, tokenizer, 512)
        groups = run_episodes(environment, batch)
        seconds = time.perf_counter() - start
        episodes = [c for group in groups for c in group]
        answers = [p.answer for p in prompts for _ in range(args.samples)]
        correct = grader.correctness([c.text for c in episodes], answers)
        calls = sum(c.tool_calls > 0 for c in episodes) / len(episodes)
        tokens = sum(len(c.token_ids) for c in episodes) / len(episodes)
        print(f"| {name} | {calls:.3f} | {sum(correct) / len(correct):.3f} | {tokens:.1f} | {seconds:.0f} |")
    grader.close()


if __name__ == "__main__":
    main()
