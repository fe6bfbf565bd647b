"""Prompt sources read from files: JSONL and Hugging Face ``datasets`` (hub or local).

Rows in TRL's formats (``prompt`` as text, or as a list of ``{role, content}`` messages with an optional system turn;
with or without an ``answer`` / ``ground_truth`` / ``final_answer`` / ``solution`` column), GSM8K's (``question`` /
``answer ... #### N``) and MATH's (``problem`` / ``solution``). Every column of a row rides along to the rewards.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from typing_extensions import override

from amir_lightning.data.base import Prompt, PromptList
from amir_lightning.helpers.extras import missing as missing_extra

#: Fields holding the prompt, tried in order: TRL's ``prompt`` (text or messages), GSM8K's ``question``, MATH's
#: ``problem``.
QUESTION_KEYS = ("prompt", "question", "problem")
#: Fields holding the reference answer, tried in order (short references before worked solutions); a dataset with
#: none of them is prompt-only.
ANSWER_KEYS = ("answer", "ground_truth", "final_answer", "solution")
ROLES = ("system", "user", "assistant")


class DataFileError(ValueError):
    """A data file is malformed; the message names the file, the line and what is wrong."""


@dataclass(frozen=True)
class RowFormat:
    """Which fields of a dataset's rows hold the prompt and the reference answer (``None``: prompt-only)."""

    question_key: str
    answer_key: str | None

    @staticmethod
    def detect(record: dict, question_key: str | None, answer_key: str | None, where: str) -> RowFormat:
        """The format of ``record`` (the first row): the configured keys, else the first known ones present."""
        question = question_key or next((k for k in QUESTION_KEYS if k in record), None)
        if question is None or question not in record:
            wanted = repr(question_key) if question_key else f"one of {list(QUESTION_KEYS)}"
            raise DataFileError(
                f"{where}: no prompt field {wanted} (keys: {sorted(record)}); a row holds TRL's `prompt` (text or "
                "messages), GSM8K's `question` or `problem`, or set question_key and answer_key"
            )
        answer = answer_key or next((k for k in ANSWER_KEYS if k in record), None)
        if answer_key and answer_key not in record:
            raise DataFileError(f"{where}: missing field {answer_key!r} (keys: {sorted(record)})")
        return RowFormat(question, answer)

    def prompt(self, record: dict, where: str) -> Prompt:
        """The ``Prompt`` of one row; every column rides along for the rewards."""
        for key in (self.question_key, self.answer_key):
            if key is not None and key not in record:
                raise DataFileError(f"{where}: missing field {key!r} (keys: {sorted(record)})")
        value = record[self.question_key]
        messages = _messages(value, where, self.question_key) if _looks_like_messages(value) else None
        if messages is None:
            question = _question_text(value, where, self.question_key)
        else:
            question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        answer = _answer_text(record[self.answer_key], where, self.answer_key) if self.answer_key else ""
        return Prompt(question, answer, {"source": where}, messages, dict(record))


_KINDS = {bool: "a boolean", dict: "an object", list: "a list"}


def _looks_like_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _messages(value: list[dict], where: str, key: str) -> tuple[dict[str, str], ...]:
    out = []
    for i, message in enumerate(value):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES or not isinstance(content, str):
            raise DataFileError(
                f"{where}: field {key!r} message {i} must be {{role: {'|'.join(ROLES)}, content: text}}, got "
                f"{json.dumps(message)[:120]}"
            )
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise DataFileError(f"{where}: field {key!r} has no user message")
    return tuple(out)


def _question_text(value, where: str, key: str) -> str:
    if isinstance(value, str) and value.strip():
        return value
    if value is None or isinstance(value, str):
        raise DataFileError(f"{where}: field {key!r} is empty")
    raise DataFileError(f"{where}: field {key!r} must be text, got {_KINDS.get(type(value), type(value).__name__)}")


def _answer_text(value, where: str, key: str) -> str:
    if isinstance(value, list):  # OlympiadBench lists final answers
        value = value[0] if value else None
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataFileError(f"{where}: field {key!r} is empty")
    if isinstance(value, bool | dict | list):
        kind = _KINDS[type(value)]
        raise DataFileError(f"{where}: field {key!r} must be text or a number, got {kind}")
    return str(value)


class JsonlPrompts(PromptList):
    """Prompts from a JSON Lines file in TRL's, GSM8K's or MATH's format (module docstring).

    Args:
        path: The ``.jsonl`` file.
        question_key: Field holding the prompt; ``None`` picks the first of ``prompt``, ``question``, ``problem``.
        answer_key: Field holding the reference answer; ``None`` picks the first of ``answer``, ``ground_truth``,
            ``final_answer``, ``solution``, and none present means a prompt-only file.
        limit: Use only the first ``limit`` records.
    """

    def __init__(
        self, path: str, question_key: str | None = None, answer_key: str | None = None, limit: int | None = None
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt file {self.path} does not exist (data.prompts.init_args.path)")
        self.items: list[Prompt] = []
        row_format: RowFormat | None = None
        for lineno, raw in enumerate(self.path.read_bytes().splitlines(), 1):
            where = f"{self.path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFileError(f"{where}: not UTF-8 text (byte {err.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise DataFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
            row_format = row_format or RowFormat.detect(record, question_key, answer_key, where)
            self.items.append(row_format.prompt(record, where))
            if limit is not None and len(self.items) >= limit:
                break
        if not self.items:
            raise DataFileError(f"{self.path}: no prompts (the file is empty)")

    @override
    def describe(self) -> str:
        return f"JsonlPrompts({self.path}, {len(self.items)} prompts)"


class HFDatasetPrompts(PromptList):
    """Prompts from Hugging Face ``datasets``: a hub id when online, local files or directories always.

    Args:
        path: Hub id (``openai/gsm8k``), a local folder (of data files, or written by ``save_to_disk``), or a builder
            name (``json``, ``parquet``) with ``data_files``.
        name: Dataset configuration (``main`` for GSM8K).
        split: Split to read.
        data_files: Local files for builder names like ``json`` or ``parquet``.
        question_key: Prompt field; ``None`` picks a known one (as ``JsonlPrompts``).
        answer_key: Answer field; ``None`` picks a known one, and none present means a prompt-only dataset.
        limit: Use only the first ``limit`` rows.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        data_files: str | Sequence[str] | None = None,
        question_key: str | None = None,
        answer_key: str | None = None,
        limit: int | None = None,
    ) -> None:
        try:
            import datasets
        except ImportError as err:
            raise missing_extra("HFDatasetPrompts", "data") from err
        self.label = f"{path}{'/' + name if name else ''}[{split}]"
        try:
            if (Path(path) / "state.json").is_file() or (Path(path) / "dataset_dict.json").is_file():
                ds = datasets.load_from_disk(path)  # a folder written by save_to_disk
                ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            else:
                ds = datasets.load_dataset(path, name, split=split, data_files=data_files)
        except Exception as err:  # datasets raises many types; the user needs to know which dataset failed
            raise DataFileError(f"could not load dataset {self.label}: {type(err).__name__}: {err}") from None
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        if len(ds) == 0:
            raise DataFileError(f"dataset {self.label} has no rows")
        missing = [k for k in (question_key, answer_key) if k and k not in ds.column_names]
        if missing:
            raise DataFileError(f"dataset {self.label}: missing column(s) {missing} (columns: {ds.column_names})")
        row_format = RowFormat.detect(ds[0], question_key, answer_key, f"dataset {self.label} row 0")
        self.items = []
        for i, row in enumerate(ds):
            prompt = row_format.prompt(row, f"dataset {self.label} row {i}")
            self.items.append(replace(prompt, meta={"source": f"{self.label}:{i}"}))

    @override
    def describe(self) -> str:
        return f"HFDatasetPrompts({self.label}, {len(self.items)} prompts)"
