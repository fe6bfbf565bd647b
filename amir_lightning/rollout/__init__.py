"""The old home of the rollout loop, the engines and the environments, kept so that every import users have works.

The code lives in three rooms: ``amir_lightning.loop`` (the rollout loop), ``amir_lightning.engines`` (the engine
seam, vLLM, the server, HF generate) and ``amir_lightning.environments`` (episodes, tools, verifiers); the ``Policy``
in ``amir_lightning.models.policy``. ``amir_lightning.rollout.VLLMEngine`` and the other names below still resolve,
and so does every module path of the old layout (``amir_lightning.rollout.vllm_engine``...): it is the same module
object as its new home, so a saved rollout pickled under an old path loads, and a patch through it reaches the code.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from amir_lightning.engines import Completion, HFEngine, RolloutEngine, SamplingConfig, VLLMEngine, VLLMServerEngine
from amir_lightning.environments import (
    CalculatorEnvironment,
    Environment,
    ToolEnvironment,
    ToolError,
    VerifiersEnvironment,
)

#: Each module of the old layout and its home now.
MOVED = {
    "engine": "engines.base",
    "digest": "engines.digest",
    "shards": "engines.shards",
    "adapters": "engines.adapters",
    "hf_engine": "engines.hf",
    "vllm_engine": "engines.vllm",
    "vllm_server": "engines.server",
    "server_setup": "engines.server_setup",
    "vllm_worker": "engines.vllm_worker",
    "episodes": "environments.base",
    "replies": "environments.replies",
    "tools": "environments.tools",
    "tool_calls": "environments.tool_calls",
    "tool_functions": "environments.tool_functions",
    "tool_runs": "environments.tool_runs",
    "calculator": "environments.calculator",
    "verifiers_env": "environments.verifiers.environment",
    "verifiers_harness": "environments.verifiers.harness",
    "verifiers_policy": "environments.verifiers.policy",
    "verifiers_scoring": "environments.verifiers.scoring",
    "types": "loop.types",
    "schedule": "loop.schedule",
    "pending": "loop.pending",
    "saved": "loop.saved",
    "sampler": "loop.sampler",
    "sync": "loop.sync",
    "rewarding": "loop.rewarding",
    "collect": "loop.collect",
    "dynamic": "loop.dynamic",
    "batch": "loop.batch",
    "policy": "models.policy",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of an old module path with the module at its new home (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        if fullname.startswith(__name__ + ".") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module("amir_lightning." + MOVED[spec.name.removeprefix(__name__ + ".")])

    def exec_module(self, module):
        """The module at the new home has run already."""


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())

__all__ = [
    "CalculatorEnvironment",
    "Environment",
    "ToolError",
    "ToolEnvironment",
    "VerifiersEnvironment",
    "Completion",
    "HFEngine",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
    "VLLMServerEngine",
]
