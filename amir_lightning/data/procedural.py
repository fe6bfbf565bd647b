"""Procedural prompt generators: no files needed, deterministic per (seed, index), with held-out splits."""

from __future__ import annotations

import hashlib
import itertools
import random
from typing import Literal

from typing_extensions import override

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.helpers.extras import missing


def _in_heldout(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _evaluate(tokens: list[str]) -> int:
    """Value of ``a op b op c ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    terms, sign, product = [], 1, int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= int(operand)
        else:
            terms.append(sign * product)
            sign, product = (1 if op == "+" else -1), int(operand)
    return sum(terms) + sign * product


class ArithmeticPrompts(PromptSource):
    """Integer arithmetic questions such as ``What is 3 + 4?`` with their answers.

    ``split`` partitions the problem space itself by a hash of the expression, so ``heldout`` problems never
    appear in ``train`` whatever the seed: evaluation on them measures generalisation, not memory.

    Args:
        num_terms: Operands per expression.
        min_value: Smallest operand.
        max_value: Largest operand.
        operators: Operators to draw from (``+``, ``-``, ``*``).
        template: Question text; ``{expression}`` is replaced by e.g. ``3 + 4``.
        split: ``train``, ``heldout`` or ``all``.
        heldout_fraction: Share of distinct expressions reserved for ``heldout``.
        order: ``random`` draws expressions (with repeats); ``enumerate`` lists every distinct expression of the
            split once, shuffled by ``seed`` (for evaluation sets; the space must hold at most 1e6 expressions).
        size: Nominal length (index space) of a ``random`` generator.
        seed: Seed of the draw.
    """

    def __init__(
        self,
        num_terms: int = 2,
        min_value: int = 0,
        max_value: int = 9,
        operators: str = "+",
        template: str = "What is {expression}?",
        split: Literal["train", "heldout", "all"] = "train",
        heldout_fraction: float = 0.2,
        order: Literal["random", "enumerate"] = "random",
        size: int = 1_000_000,
        seed: int = 0,
    ) -> None:
        errors = []
        if num_terms < 1:
            errors.append(f"num_terms must be >= 1, got {num_terms}")
        if min_value > max_value:
            errors.append(f"min_value {min_value} > max_value {max_value}")
        if not operators or set(operators) - set("+-*"):
            errors.append(f"operators must be drawn from '+-*', got {operators!r}")
        if "{expression}" not in template:
            errors.append(f"template must contain '{{expression}}', got {template!r}")
        if split not in ("train", "heldout", "all"):
            errors.append(f"split must be train, heldout or all, got {split!r}")
        if not 0 < heldout_fraction < 1:  # checked even when split is all: a NaN is a typo wherever it stands
            errors.append(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        if order not in ("random", "enumerate"):
            errors.append(f"order must be random or enumerate, got {order!r}")
        values = max_value - min_value + 1
        space = values**num_terms * len(set(operators)) ** (num_terms - 1)
        if order == "enumerate" and space > 1_000_000:
            errors.append(f"order=enumerate needs a space of at most 1e6 expressions, this one has {space}")
        if errors:
            raise ValueError("; ".join(errors))
        self.num_terms, self.min_value, self.max_value = num_terms, min_value, max_value
        self.operators, self.template, self.split = operators, template, split
        self.heldout_fraction, self.size, self.seed = heldout_fraction, size, seed
        self.listing: list[str] | None = None
        self.is_random = order == "random"
        if order == "enumerate":
            self.listing = [e for e in self._all_expressions() if self._in_split(e)]
            random.Random(seed).shuffle(self.listing)
            if not self.listing:
                raise ValueError(f"split {split!r} of this arithmetic space is empty; widen the value range")

    def _all_expressions(self):
        numbers = [str(v) for v in range(self.min_value, self.max_value + 1)]
        for operands in itertools.product(numbers, repeat=self.num_terms):
            for ops in itertools.product(sorted(set(self.operators)), repeat=self.num_terms - 1):
                parts = [operands[0]]
                for op, operand in zip(ops, operands[1:]):
                    parts += [op, operand]
                yield " ".join(parts)

    def _in_split(self, expression: str) -> bool:
        return self.split == "all" or _in_heldout(expression, self.heldout_fraction) == (self.split == "heldout")

    def __len__(self) -> int:
        return len(self.listing) if self.listing is not None else self.size

    def _expression(self, rng: random.Random) -> str:
        parts = [str(rng.randint(self.min_value, self.max_value))]
        for _ in range(self.num_terms - 1):
            parts += [rng.choice(self.operators), str(rng.randint(self.min_value, self.max_value))]
        return " ".join(parts)

    def __getitem__(self, index: int) -> Prompt:
        if self.listing is not None:
            return self._prompt(self.listing[index % len(self.listing)])
        rng = random.Random(f"{self.seed}:{index}")
        for _ in range(10_000):  # rejection sampling into the split
            expression = self._expression(rng)
            if self._in_split(expression):
                return self._prompt(expression)
        raise ValueError(f"split {self.split!r} of this arithmetic space is empty; widen the value range")

    def _prompt(self, expression: str) -> Prompt:
        answer = str(_evaluate(expression.split()))
        # Only the placeholder is replaced: '{expression}= Put the answer in \\boxed{}.' keeps its other braces.
        question = self.template.replace("{expression}", expression)
        return Prompt(question, answer, {"expression": expression})

    @override
    def describe(self) -> str:
        return (
            f"ArithmeticPrompts({self.num_terms} terms in [{self.min_value}, {self.max_value}], "
            f"ops {self.operators!r}, split {self.split})"
        )


class ReasoningGymPrompts(PromptSource):
    """Procedural tasks from ``reasoning-gym`` (e.g. ``chain_sum``, ``basic_arithmetic``, ``gsm_symbolic``).

    Args:
        task: reasoning-gym dataset name.
        size: Number of generated problems.
        seed: Generator seed.
        config: Extra keyword arguments of the task's config (e.g. ``{"min_terms": 2, "max_terms": 3}``).
    """

    def __init__(self, task: str = "chain_sum", size: int = 10_000, seed: int = 0, config: dict | None = None) -> None:
        try:
            import reasoning_gym
        except ImportError as err:
            raise missing("ReasoningGymPrompts", "reasoning-gym") from err
        try:
            self.dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **(config or {}))
        except Exception as err:
            raise ValueError(f"reasoning-gym task {task!r} with config {config} failed: {err}") from None
        self.task, self.size = task, size
        self.is_random = True

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        item = self.dataset[index % self.size]
        return Prompt(str(item["question"]), str(item["answer"]), {"task": self.task, "index": index % self.size})

    @override
    def describe(self) -> str:
        return f"ReasoningGymPrompts({self.task}, {self.size})"
