"""Prompt rendering through the tokenizer's chat template, and the paper's answer-format system prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amir_lightning.data.base import Prompt
from amir_lightning.data.template_checks import check_structure, unsafe_access

#: The paper's base template (arXiv 2601.03661's code): reason in <think>, answer in <answer> with a boxed final answer.
#: Unlike the official string, the braces are not doubled (it was never ``.format()``-ed, so models saw ``{{}}``).
THINK_ANSWER_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process is enclosed within <think> </think> and the answer is enclosed within "
    "<answer> </answer> tags. Reason step by step, and put your final answer within \\boxed{}.\n"
    "<think>\nreasoning process here\n</think>\n<answer>\n\\boxed{final answer here}\n</answer>"
)


@dataclass(frozen=True)
class ChatFormat:
    """How a prompt becomes the policy's input: a system message, the chat template and its variables.

    Attributes:
        system_prompt: System message prepended to every prompt that has none of its own.
        template: A Jinja chat template (text) used instead of the tokenizer's own; ``None``: the tokenizer's.
        template_kwargs: Variables the template reads, passed to ``apply_chat_template`` (Qwen3's
            ``enable_thinking: false``, for example).
        tools: The JSON schemas of the tools the policy may call (``environments/tools.py``), which the
            template shows it.
        example_turns: Chat messages shown before every prompt's own, after the system prompt: a worked example (a
            question, a tool call, its result, the answer) that a small model follows more often than a description.
    """

    system_prompt: str | None = None
    template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    example_turns: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, chat: ChatFormat | str | None) -> ChatFormat:
        """``chat`` as a ``ChatFormat`` (a string is a system prompt)."""
        return chat if isinstance(chat, ChatFormat) else cls(system_prompt=chat)

    def check(self, tokenizer, where: str = "data") -> None:
        """Stop with one line when there is no chat template for ``template_kwargs`` to reach, or it does not render.

        A template of ``chat_template`` (untrusted input) is also refused when it names a Python internal, or
        drops the user's message or the system prompt, or writes no generation prompt (``template_checks.py``).
        """
        if self.template:
            probe = {"messages": self.messages(Prompt(question="1 + 1", answer="")), "add_generation_prompt": True}
            unsafe = unsafe_access(
                self.template, probe | getattr(tokenizer, "special_tokens_map", {}) | self.template_kwargs
            )
            if unsafe:
                raise ValueError(
                    f"{where}.chat_template reaches for Python internals ({unsafe}): a chat template is rendered "
                    "sandboxed and may not use names starting with '_'"
                )
        if not (self.template or getattr(tokenizer, "chat_template", None)):
            if self.template_kwargs:
                raise ValueError(
                    f"{where}.chat_template_kwargs ({', '.join(sorted(self.template_kwargs))}) has nothing to reach: "
                    f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'the policy')} has no chat template "
                    f"(give one with {where}.chat_template)"
                )
            return
        try:
            self.render(tokenizer, Prompt(question="1 + 1", answer=""))
        except Exception as err:  # noqa: BLE001 - a template error is the user's, said in one line
            raise ValueError(
                f"{where}.chat_template does not render a prompt: {type(err).__name__}: {err}"
                if self.template
                else f"the tokenizer's chat template does not render a prompt: {type(err).__name__}: {err}"
            ) from None
        wrong = self.template and check_structure(tokenizer, self.template, self.system_prompt, self.template_kwargs)
        if wrong:
            raise ValueError(f"{where}.chat_template {wrong}")

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat messages of ``prompt``.

        A conversational prompt keeps its own messages (a system turn among them replaces ``system_prompt``);
        otherwise the system prompt, then the question as the user message. ``example_turns`` go after the system
        turn.
        """
        system, examples = self.system_prompt, [dict(m) for m in self.example_turns or []]
        if prompt.messages is not None:
            own = [dict(m) for m in prompt.messages]
            if system and not any(m["role"] == "system" for m in own):
                own = [{"role": "system", "content": system}, *own]
            at = 1 if own and own[0]["role"] == "system" else 0  # the examples go after a leading system turn
            return [*own[:at], *examples, *own[at:]]
        messages = [{"role": "system", "content": system}] if system else []
        return [*messages, *examples, {"role": "user", "content": prompt.question}]

    def render(self, tokenizer, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` in the chat template, ending with the assistant's turn header.

        A tokenizer without a chat template (and none given) gets the messages' texts, one per line.
        """
        messages = self.messages(prompt)
        if self.template or getattr(tokenizer, "chat_template", None):
            encoded = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **self._template_args()
            )
            ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
            return list(ids)
        text = "".join(m["content"] + "\n" for m in messages)
        return tokenizer(text, add_special_tokens=True)["input_ids"]

    def text(self, tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """``messages`` rendered by the chat template, as text (a tool's results between two turns)."""
        if not (self.template or getattr(tokenizer, "chat_template", None)):
            raise ValueError(
                f"tools need a chat template: the tokenizer of {getattr(tokenizer, 'name_or_path', 'the policy')} "
                "has none (give one with data.chat_template, e.g. configs/templates/chatml_tools.jinja)"
            )
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **self._template_args()
        )

    def _template_args(self) -> dict[str, Any]:
        tools = {"tools": self.tools} if self.tools else {}
        return {"chat_template": self.template, **tools, **self.template_kwargs}


def read_template(template: str | None) -> str | None:
    """A chat template given as Jinja text or as the path of a file that holds it (``.jinja``, ``.j2``, ``.txt``)."""
    if template is None or "{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise ValueError(
            f"data.chat_template: {template!r} is neither a Jinja template (no '{{') nor a file "
            f"(looked in {path.resolve().parent})"
        )
    return path.read_text(encoding="utf-8")


def render_prompt(tokenizer, prompt: Prompt, chat: ChatFormat | str | None = None) -> list[int]:
    """Token ids of ``prompt`` in the chat template, ending with the assistant's turn header.

    ``chat``: the ``ChatFormat``, or just a system prompt.
    """
    return ChatFormat.of(chat).render(tokenizer, prompt)


def render_prompts(
    tokenizer, prompts: list[Prompt], chat: ChatFormat | str | None, max_tokens: int, source: str
) -> list[list[int]]:
    """``render_prompt`` for each prompt; one longer than ``max_tokens`` is an error naming where it came from."""
    out = []
    chat = ChatFormat.of(chat)
    for prompt in prompts:
        ids = chat.render(tokenizer, prompt)
        if len(ids) > max_tokens:
            raise ValueError(
                f"prompt from {prompt.meta.get('source', source)} has {len(ids)} tokens after the chat template, "
                f"over the limit of {max_tokens} (data.max_prompt_tokens, or the engine's max_model_len minus "
                "data.sampling.max_new_tokens)"
            )
        out.append(ids)
    return out
