"""Prompt sources read from files: JSONL (GSM8K or generic keys) and Hugging Face ``datasets`` (hub or local)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from amir_lightning.data.base import Prompt, PromptSource

#: Key pairs recognised by ``question_key=None`` / ``answer_key=None``, in order.
KNOWN_KEYS: tuple[tuple[str, str], ...] = (
    ("question", "answer"),  # GSM8K: answer ends with "#### N"
    ("prompt", "answer"),
    ("problem", "answer"),  # MATH-500, AIME, AMC
    ("problem", "solution"),
    ("question", "final_answer"),  # OlympiadBench
)


class DataFileError(ValueError):
    """A data file is malformed; the message names the file, the line and what is wrong."""


def _pick_keys(record: dict, question_key: str | None, answer_key: str | None, where: str) -> tuple[str, str]:
    if question_key and answer_key:
        return question_key, answer_key
    for q, a in KNOWN_KEYS:
        if (question_key in (None, q)) and (answer_key in (None, a)) and q in record and a in record:
            return q, a
    raise DataFileError(
        f"{where}: no question/answer fields found (keys: {sorted(record)}); set question_key and answer_key"
    )


_KINDS = {bool: "a boolean", dict: "an object", list: "a list"}


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


class JsonlPrompts(PromptSource):
    """Prompts from a JSON Lines file: GSM8K (``question``/``answer`` ending ``#### N``) or generic keys.

    Args:
        path: The ``.jsonl`` file.
        question_key: Field holding the question; ``None`` picks the first known pair (``question``,
            ``prompt``, ``problem``).
        answer_key: Field holding the reference answer; ``None`` picks it with ``question_key``.
        limit: Use only the first ``limit`` records.
    """

    def __init__(
        self, path: str, question_key: str | None = None, answer_key: str | None = None, limit: int | None = None
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt file {self.path} does not exist (data.prompts.init_args.path)")
        self.items: list[Prompt] = []
        keys: tuple[str, str] | None = None
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
            keys = keys or _pick_keys(record, question_key, answer_key, where)
            q, a = keys
            if q not in record or a not in record:
                missing = q if q not in record else a
                raise DataFileError(f"{where}: missing field {missing!r} (keys: {sorted(record)})")
            question = _question_text(record[q], where, q)
            self.items.append(Prompt(question, _answer_text(record[a], where, a), {"source": where}))
            if limit is not None and len(self.items) >= limit:
                break
        if not self.items:
            raise DataFileError(f"{self.path}: no prompts (the file is empty)")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Prompt:
        return self.items[index % len(self.items)]

    def describe(self) -> str:  # noqa: D102
        return f"JsonlPrompts({self.path}, {len(self.items)} prompts)"


class HFDatasetPrompts(PromptSource):
    """Prompts from Hugging Face ``datasets``: a hub id when online, local files or directories always.

    Args:
        path: Hub id (``openai/gsm8k``), a local dataset directory, or a builder name (``json``) with ``data_files``.
        name: Dataset configuration (``main`` for GSM8K).
        split: Split to read.
        data_files: Local files for builder names like ``json`` or ``parquet``.
        question_key: Question field; ``None`` picks a known one.
        answer_key: Answer field; ``None`` picks a known one.
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
            raise ModuleNotFoundError("HFDatasetPrompts needs `datasets`: pip install 'amir-lightning[data]'") from err
        self.label = f"{path}{'/' + name if name else ''}[{split}]"
        try:
            ds = datasets.load_dataset(path, name, split=split, data_files=data_files)
        except Exception as err:  # datasets raises many types; the user needs to know which dataset failed
            raise DataFileError(f"could not load dataset {self.label}: {type(err).__name__}: {err}") from None
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        if len(ds) == 0:
            raise DataFileError(f"dataset {self.label} has no rows")
        q, a = _pick_keys(ds[0], question_key, answer_key, f"dataset {self.label} row 0")
        missing = [k for k in (q, a) if k not in ds.column_names]
        if missing:
            raise DataFileError(f"dataset {self.label}: missing column(s) {missing} (columns: {ds.column_names})")
        self.items = [
            Prompt(
                _question_text(row[q], f"dataset {self.label} row {i}", q),
                _answer_text(row[a], f"dataset {self.label} row {i}", a),
                {"source": f"{self.label}:{i}"},
            )
            for i, row in enumerate(ds)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Prompt:
        return self.items[index % len(self.items)]

    def describe(self) -> str:  # noqa: D102
        return f"HFDatasetPrompts({self.label}, {len(self.items)} prompts)"
