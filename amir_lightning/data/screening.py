"""Every prompt of a finite source checked once, when the data opens: which cannot be used, and why.

A prompt cannot be used when it is longer than the limit after the chat template, when the tokenizer cannot encode
it (a lone surrogate from a JSON escape), or when its user message is empty. Characters the tokenizer loses (a small
alphabet's tokenizer drops them, others turn them into an unknown token) do not stop a prompt; they are reported.
The data module decides what to do with what is found (``data.bad_prompts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.data.templates import ChatFormat


@dataclass
class Screening:
    """What screening a source found.

    Attributes:
        bad: Index of each prompt that cannot be used -> ``"where (why)"`` (file and line, or dataset index).
        lost: ``"where ('characters')"`` for each usable prompt with characters the tokenizer loses.
        answered: Prompts with a reference answer.
    """

    bad: dict[int, str] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    answered: int = 0


def screen(source: PromptSource, tokenizer, chat: ChatFormat, limit: int, progress: bool) -> Screening:
    """Render every prompt of ``source`` once (a bar over them when ``progress`` and there are many)."""
    indices = range(len(source))
    if progress and len(source) > 2000:
        from tqdm.auto import tqdm

        indices = tqdm(indices, desc="checking prompts", unit="prompt", leave=False)
    found = Screening()
    for index in indices:
        prompt = source[index]
        found.answered += bool(prompt.answer.strip())
        where = prompt.meta.get("source", f"{source.describe()}[{index}]")
        if (reason := unusable(tokenizer, prompt, chat, limit)) is not None:
            found.bad[index] = f"{where} ({reason})"
        elif lost := lost_characters(tokenizer, prompt):
            found.lost.append(f"{where} ({lost!r})")
    return found


def unusable(tokenizer, prompt: Prompt, chat: ChatFormat, limit: int) -> str | None:
    """Why ``prompt`` cannot be trained on; ``None`` when it can."""
    if prompt.messages is not None and any(m["role"] == "user" and not m["content"].strip() for m in prompt.messages):
        return "an empty user message"
    try:
        ids = chat.render(tokenizer, prompt)
    except Exception as err:  # noqa: BLE001 - any failure to encode is this row's, named with its cause
        return f"the tokenizer cannot encode it: {type(err).__name__}: {str(err)[:80]}"
    return f"{len(ids)} tokens" if len(ids) > limit else None


def lost_characters(tokenizer, prompt: Prompt) -> str:
    """The characters of ``prompt``'s text that do not survive the tokenizer (encode, decode), if any.

    Whitespace, which tokenizers normalise, is not compared.
    """
    texts = [m["content"] for m in prompt.messages] if prompt.messages is not None else [prompt.question]
    lost = ""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        kept = "".join(tokenizer.decode(ids, skip_special_tokens=True).split())
        lost += "".join(sorted(set("".join(text.split())) - set(kept)))
    return lost


def check_references(source: PromptSource, answered: int, reward) -> None:
    """A reward that grades against reference answers (``reward``, else ``None``) needs a source with some."""
    if reward is None or answered or not len(source):
        return
    columns = ", ".join(sorted(source[0].row)) or "none"
    raise ValueError(
        f"data.rewards: {type(reward).__name__} grades against reference answers, but no training prompt of "
        f"{source.describe()} has one (its rows have the columns: {columns}); name the answer column with "
        "data.prompts.init_args.answer_key"
    )
