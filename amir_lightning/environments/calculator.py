"""The calculator tool of multi-turn rollouts: arithmetic parsed from the policy's call, bounded in time and memory.

Model output is untrusted: an expression is parsed, never ``eval``-ed, and its cost is bounded before it is computed.
An expression is at most ``max_chars`` characters and ``max_depth`` operations deep, and no integer may grow past
``max_digits`` digits: a power or product is refused from its operands' sizes, before Python would build it. Without
the size bound ``((((10**64)**64)**64)**64)`` ran 26 s and then failed to print (Python's 4300-digit limit), ending
the run; ``-`` written 10,000 times made the parser raise ``MemoryError``. Each is now an error the policy reads
(``ToolError``), counted in ``tools/error_frac``, within a millisecond.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.environments.base import Environment
from amir_lightning.environments.replies import ToolError
from amir_lightning.helpers.validation import check_number, raise_errors

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate_arithmetic(
    expression: str, max_exponent: int = 64, max_digits: int = 1000, max_chars: int = 1000, max_depth: int = 200
) -> float | int:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ``ValueError`` otherwise.

    Args:
        expression: The policy's text between the call's tags.
        max_exponent: Largest exponent of a power, in absolute value.
        max_digits: Most digits of any integer on the way (an operand, an intermediate value, the result).
        max_chars: Longest expression.
        max_depth: Deepest nesting of operations and parentheses.

    Returns:
        The value: an int when every step was exact, else a float.
    """
    if len(expression) > max_chars:
        raise ValueError(f"expression of {len(expression)} characters is over {max_chars}")
    max_bits = math.ceil(max_digits * math.log2(10))
    try:
        text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as err:  # the parser's own depth guards
        raise ValueError(f"{type(err).__name__}: {err}") from None
    _check_depth(tree.body, max_depth)

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _bounded(node.value, max_bits, max_digits)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            _check_size(node.op, left, right, max_exponent, max_bits, max_digits)
            return _bounded(_OPERATORS[type(node.op)](left, right), max_bits, max_digits)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return value(tree.body)
    except (ZeroDivisionError, OverflowError, RecursionError) as err:  # RecursionError: called from a deep stack
        raise ValueError(f"{type(err).__name__}: {err}") from None


def _check_depth(root: ast.AST, max_depth: int) -> None:
    """``ValueError`` when the tree is deeper than ``max_depth`` (walked with a stack: no recursion to overflow)."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"expression nested over {max_depth} deep")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _check_size(op: ast.operator, left, right, max_exponent: int, max_bits: int, max_digits: int) -> None:
    """Refuse a power or product whose result would be over ``max_bits``, from its operands' sizes alone."""
    if isinstance(op, ast.Pow) and abs(right) > max_exponent:
        raise ValueError(f"exponent {right} is over {max_exponent}")
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # a float overflows on its own (OverflowError) or becomes inf, at no cost
    if isinstance(op, ast.Pow) and right > 0 and (left.bit_length() - 1) * right > max_bits:
        raise ValueError(f"result over {max_digits} digits")
    if isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() - 1 > max_bits:
        raise ValueError(f"result over {max_digits} digits")


def _bounded(result, max_bits: int, max_digits: int):
    """``result``, unless it is an integer over ``max_bits`` or not a real number (a negative number's root)."""
    if isinstance(result, complex):
        raise ValueError("not a real number")
    if isinstance(result, int) and result.bit_length() > max_bits:
        raise ValueError(f"result over {max_digits} digits")
    return result


class CalculatorEnvironment(Environment):
    """A calculator the policy calls by writing ``<calc>expression</calc>``; it replies ``<result>value</result>``.

    Tell the policy about it in the system prompt (``data.system_prompt``), with one worked call: a small model
    follows an example far more often than a description (SmolLM2-135M: 5 % of episodes against 1.6 %,
    ``benchmarks/tool_use.py``), and RL needs some calling episodes to start from. ``configs/demo_calculator.yaml``
    uses "You can use a calculator: write <calc>expression</calc> and the result follows as <result>value</result>."
    followed by a question and an answer that calls it.

    An expression it cannot compute (not arithmetic, a division by zero, over ``max_digits``) is answered with
    ``error_reply``: an outcome of the episode, counted in ``tools/error_frac``, not an error of the run.

    Args:
        open: The text that starts a call.
        close: The text that ends it (a stop string: the turn ends there and the calculator replies).
        reply: The reply, with ``{value}``.
        error_reply: The reply to an expression it cannot compute, with ``{error}``.
        max_turns: Policy turns per episode.
        max_reply_tokens: Longest reply in tokens.
        max_digits: Most digits of any integer in a computation (``evaluate_arithmetic``).
    """

    def __init__(
        self,
        open: str = "<calc>",
        close: str = "</calc>",
        reply: str = "<result>{value}</result>",
        error_reply: str = "<result>error: {error}</result>",
        max_turns: int = 4,
        max_reply_tokens: int = 64,
        max_digits: int = 1000,
    ) -> None:
        if not open or not close:
            raise ValueError("data.environment.init_args.open and close must be non-empty strings")
        errors: list[str] = []
        check_number(errors, "data.environment.init_args.max_digits", max_digits, ge=1, le=4000)  # str() of an int
        for key, template, field in (("reply", reply, "value"), ("error_reply", error_reply, "error")):
            try:
                template.format(**{field: "1"})
            except (KeyError, IndexError, ValueError) as err:
                errors.append(f"data.environment.init_args.{key} {template!r} must hold only {{{field}}} ({err!r})")
        raise_errors(errors)
        super().__init__(max_turns=max_turns, stop=[close], max_reply_tokens=max_reply_tokens)
        self.open, self.close, self.reply, self.error_reply = open, close, reply, error_reply
        self.max_digits = max_digits
        self.call = re.compile(re.escape(open) + r"(.*?)" + re.escape(close), re.DOTALL)

    @override
    def reset(self, prompt: Prompt) -> None:
        return None

    def step(self, state: None, message: str) -> str | None:
        """The result of the turn's last call; ``None`` when the turn made none (the policy has answered).

        Raises:
            ToolError: The expression cannot be computed; its message (``error_reply``) is the reply.
        """
        calls = self.call.findall(message)
        if not calls:
            return None
        try:
            value = evaluate_arithmetic(calls[-1], max_digits=self.max_digits)
        except ValueError as err:
            raise ToolError(self.error_reply.format(error=str(err)[:80])) from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return self.reply.format(value=f"{value:.6g}" if isinstance(value, float) else value)


# The calculator as a tool the chat template shows (data.tools: [amir_lightning.environments.calculator.calculator],
# tools.py), bounded as evaluate_arithmetic is: an expression it cannot compute raises ValueError, which the
# policy reads as an error result. Its docstring is what the policy is shown (the tool's schema).
def calculator(expression: str) -> str:
    """Compute an arithmetic expression: numbers, + - * / // % **, and parentheses.

    Args:
        expression: The expression to compute, for example 37*8.
    """
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)
