"""Prompt rendering through the tokenizer's chat template, and the paper's answer-format system prompt."""

from __future__ import annotations

from amir_lightning.data.base import Prompt

#: The paper's base template (arXiv 2601.03661's code): reason in <think>, answer in <answer> with a boxed final answer.
#: Unlike the official string, the braces are not doubled (it was never ``.format()``-ed, so models saw ``{{}}``).
THINK_ANSWER_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process is enclosed within <think> </think> and the answer is enclosed within "
    "<answer> </answer> tags. Reason step by step, and put your final answer within \\boxed{}.\n"
    "<think>\nreasoning process here\n</think>\n<answer>\n\\boxed{final answer here}\n</answer>"
)


def prompt_messages(prompt: Prompt, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages of ``prompt``.

    A conversational prompt keeps its own messages (a system turn among them replaces ``system_prompt``); otherwise
    the system prompt, then the question as the user message.
    """
    if prompt.messages is not None:
        own = [dict(m) for m in prompt.messages]
        has_system = any(m["role"] == "system" for m in own)
        return own if has_system or not system_prompt else [{"role": "system", "content": system_prompt}, *own]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": prompt.question}]


def render_prompt(tokenizer, prompt: Prompt, system_prompt: str | None = None) -> list[int]:
    """Token ids of ``prompt`` in the tokenizer's chat template, ending with the assistant's turn header."""
    messages = prompt_messages(prompt, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return list(ids)
    text = "".join(m["content"] + "\n" for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def render_prompts(
    tokenizer, prompts: list[Prompt], system_prompt: str | None, max_tokens: int, source: str
) -> list[list[int]]:
    """``render_prompt`` for each prompt; one longer than ``max_tokens`` is an error naming where it came from."""
    out = []
    for prompt in prompts:
        ids = render_prompt(tokenizer, prompt, system_prompt)
        if len(ids) > max_tokens:
            raise ValueError(
                f"prompt from {prompt.meta.get('source', source)} has {len(ids)} tokens after the chat template, "
                f"over the limit of {max_tokens} (data.max_prompt_tokens, or the engine's max_model_len minus "
                "data.sampling.max_new_tokens)"
            )
        out.append(ids)
    return out
