"""The official evaluation's math benchmarks, by Hugging Face id when online and from local files always."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from typing_extensions import override

from amir_lightning.data.base import Prompt, PromptList
from amir_lightning.data.files import DataFileError
from amir_lightning.helpers.extras import missing

#: name -> hub location and fields. ``question``/``answer`` list the field names tried in order.
PRESETS: dict[str, dict[str, Any]] = {
    "gsm8k": {"path": "openai/gsm8k", "name": "main", "split": "test", "question": ["question"], "answer": ["answer"]},
    "math500": {"path": "HuggingFaceH4/MATH-500", "split": "test", "question": ["problem"], "answer": ["answer"]},
    "aime25": {"path": "math-ai/aime25", "split": "test", "question": ["problem", "question"], "answer": ["answer"]},
    "amc23": {"path": "math-ai/amc23", "split": "test", "question": ["question", "problem"], "answer": ["answer"]},
    "olympiadbench": {
        "path": "Hothan/OlympiadBench",
        "name": "OE_TO_maths_en_COMP",
        "split": "train",
        "question": ["question"],
        "answer": ["final_answer"],
    },
    "minervamath": {
        "path": "math-ai/minervamath",
        "split": "test",
        "question": ["question", "problem"],
        "answer": ["answer"],
    },
    "aqua_rat": {"path": "deepmind/aqua_rat", "split": "test", "question": ["question"], "answer": ["correct"]},
    "livemathbench": {
        "path": "opencompass/LiveMathBench",
        "name": "v202412_AMC_en",
        "split": "test",
        "question": ["question"],
        "answer": ["answer"],
    },
}
_OPTION = re.compile(r"^\s*\(?([A-E])\)\s*(.*)$", re.DOTALL)


def _first(record: dict, keys: list[str], where: str) -> Any:
    for key in keys:
        if key in record and record[key] not in (None, "", []):
            return record[key]
    raise DataFileError(f"{where}: none of the fields {keys} is present (fields: {sorted(record)})")


def _to_prompt(name: str, record: dict, where: str) -> Prompt:
    preset = PRESETS[name]
    question = str(_first(record, preset["question"], where))
    answer = _first(record, preset["answer"], where)
    if isinstance(answer, list):  # OlympiadBench: a list of acceptable final answers; the first is graded
        answer = answer[0]
    answer = str(answer)
    if name == "aqua_rat":  # the reference is the text of the correct option, its "A)" label stripped
        options = {m.group(1): m.group(2).strip() for m in map(_OPTION.match, record["options"]) if m}
        if answer not in options:
            raise DataFileError(f"{where}: correct option {answer!r} is not among {sorted(options)}")
        question = question + "\nOptions: " + " ".join(record["options"])
        answer = options[answer]
    if name == "livemathbench":
        answer = answer.strip().strip("$").strip()
    return Prompt(question, answer, {"source": where, "benchmark": name})


class BenchmarkPrompts(PromptList):
    """One of the paper's benchmarks, by name.

    Names: ``gsm8k``, ``math500``, ``aime25``, ``amc23``, ``olympiadbench``, ``minervamath``, ``aqua_rat``,
    ``livemathbench``.

    Args:
        name: Benchmark name.
        path: A local ``.jsonl``, ``.json`` or ``.parquet`` file with the dataset's own fields; ``None`` loads the
            hub id of the preset (needs the network the first time).
        limit: Evaluate only the first ``limit`` problems.
    """

    def __init__(self, name: str, path: str | None = None, limit: int | None = None) -> None:
        if name not in PRESETS:
            raise ValueError(f"unknown benchmark {name!r}; known: {sorted(PRESETS)}")
        self.name = name
        records, label = self._load(name, path)
        if limit is not None:
            records = records[:limit]
        if not records:
            raise DataFileError(f"benchmark {name} ({label}) has no problems")
        self.items = [_to_prompt(name, r, f"{label}:{i + 1}") for i, r in enumerate(records)]

    @staticmethod
    def _load(name: str, path: str | None) -> tuple[list[dict], str]:
        try:
            import datasets
        except ImportError as err:
            raise missing("benchmarks", "data") from err
        preset = PRESETS[name]
        if path is not None:
            file = Path(path)
            if not file.is_file():
                raise FileNotFoundError(f"benchmark file {file} does not exist (benchmark {name})")
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(file.suffix)
            if builder is None:
                raise ValueError(f"benchmark file {file} must be .jsonl, .json or .parquet")
            ds = datasets.load_dataset(builder, data_files=str(file), split="train")
            return list(ds), str(file)
        label = f"{preset['path']}[{preset['split']}]"
        try:
            ds = datasets.load_dataset(preset["path"], preset.get("name"), split=preset["split"])
        except Exception as err:
            raise DataFileError(f"could not load benchmark {name} from {label}: {type(err).__name__}: {err}") from None
        return list(ds), label

    @override
    def describe(self) -> str:
        return f"BenchmarkPrompts({self.name}, {len(self.items)} problems)"
