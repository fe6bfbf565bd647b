"""The tasks of a verifiers taskset as prompts (verifiers 0.4: ``pip install 'amir-lightning[verifiers]'``).

A taskset written for prime-rl (a ``vf.Taskset`` whose ``load`` yields ``vf.Task`` objects, its rewards ``@vf.reward``
methods of the task) is read here unchanged; ``VerifiersEnvironment`` (``environments/verifiers/``) runs its episodes
and scores them with its rewards.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from typing_extensions import override

from amir_lightning.data.base import Prompt, PromptSource


def import_verifiers(key: str):
    """``verifiers.v1``, or one line saying how to install it (naming ``key``)."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ImportError(
            f"{key} needs the verifiers package (0.4): pip install 'amir-lightning[verifiers]' ({err})"
        ) from None
    return vf


def taskset_config(environment: str | dict[str, Any], key: str) -> dict[str, Any]:
    """The verifiers environment config of ``environment``, as a plain dict.

    ``environment`` is a taskset id, a config as ``vf.resolve_env_config`` takes it (``{taskset: {id: ...,
    <the taskset's options>}, agent: {...}}``), a verifiers ``EnvConfig``, or an environment ``vf.load_environment``
    loaded (its config).

    Raises:
        ValueError: It names no taskset.
    """
    if hasattr(environment, "model_dump"):  # a verifiers EnvConfig
        environment = environment.model_dump(mode="json", exclude_none=True)
    elif hasattr(getattr(environment, "config", None), "model_dump"):  # an environment verifiers loaded
        environment = environment.config.model_dump(mode="json", exclude_none=True)
    raw = {"taskset": {"id": environment}} if isinstance(environment, str) else json.loads(json.dumps(environment))
    if not isinstance(raw, dict) or not isinstance(raw.get("taskset"), dict) or not raw["taskset"].get("id"):
        raise ValueError(f"{key} must be a verifiers taskset id or a config with taskset.id, got {environment!r}")
    return raw


@functools.cache
def _tasks(taskset_json: str) -> tuple:
    vf = import_verifiers("data.prompts")
    config = vf.resolve_env_config({"taskset": json.loads(taskset_json)})
    return tuple(vf.load_taskset(config.taskset))


def load_tasks(taskset: dict[str, Any], key: str) -> tuple:
    """The tasks of the taskset config ``taskset`` (``{id: ..., <options>}``), in its order (loaded once per process).

    Raises:
        ValueError: verifiers cannot load it (its module is not importable, an option is wrong); names ``key``.
    """
    try:
        return _tasks(json.dumps(taskset, sort_keys=True))
    except Exception as err:  # noqa: BLE001 - verifiers says what is wrong; say where
        raise ValueError(f"{key}: the verifiers taskset {taskset.get('id')!r}: {type(err).__name__}: {err}") from None


def task_messages(task) -> list[dict[str, Any]]:
    """The task's prompt as chat messages: its system prompt, then its prompt (a user message, or its messages)."""
    from verifiers.v1.dialects.chat import message_to_wire

    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [*messages, *(message_to_wire(m) for m in data.prompt or [])]


class VerifiersTasks(PromptSource):
    """The tasks of a verifiers taskset, in its order (``data.prompts``), for ``VerifiersEnvironment``.

    Each prompt is the task's messages (its system prompt, then its prompt); its reference answer is the task's
    ``answer`` field where it has one, and its other fields are the columns rewards see.

    Args:
        environment: The taskset's id (its importable module), or a verifiers environment config as
            ``vf.resolve_env_config`` takes it (``{taskset: {id: ..., <the taskset's options>}}``); give
            ``data.environment`` the same.
    """

    def __init__(self, environment: str | dict[str, Any]) -> None:
        key = "data.prompts.init_args.environment"
        import_verifiers(key)
        self.taskset = taskset_config(environment, key)["taskset"]
        self.tasks = load_tasks(self.taskset, key)
        if not self.tasks:
            raise ValueError(f"{key}: the verifiers taskset {self.taskset['id']!r} has no tasks")

    @override
    def __len__(self) -> int:
        return len(self.tasks)

    @override
    def __getitem__(self, index: int) -> Prompt:
        task = self.tasks[index]
        messages = task_messages(task)
        users = [m["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], str)]
        columns = task.data.model_dump(mode="json", exclude_defaults=True)
        answer = columns.get("answer", "")
        meta = {"source": f"verifiers:{self.taskset['id']}", "task": index}
        return Prompt(users[-1] if users else "", "" if answer is None else str(answer), meta, tuple(messages), columns)

    @override
    def describe(self) -> str:
        return f"verifiers taskset {self.taskset['id']} ({len(self)} tasks)"
