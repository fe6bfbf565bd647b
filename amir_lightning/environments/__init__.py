"""Environments: what answers the policy between its turns. One seam, ``Environment`` (``base.py``).

- ``base.py``: the seam and ``run_episodes``, which plays B x G episodes turn by turn through any engine and
  returns each as a ``Completion`` with its ``EpisodeRecord``.
- ``replies.py``: how a reply is bounded, encoded and counted; ``ToolError`` for a call the policy should read.
- ``tools.py``: ``ToolEnvironment``, Python functions as tools through the model's chat template;
  ``tool_calls.py`` parses the calls, ``tool_functions.py`` turns a function into a tool, ``tool_runs.py`` runs a
  turn's calls together under one deadline.
- ``calculator.py``: ``CalculatorEnvironment`` and the ``calculator`` tool.
- ``verifiers/``: ``VerifiersEnvironment``, a verifiers taskset as an environment.

An environment imports the engine seam's ``Completion`` and nothing of the loop or the systems. A new environment
is a file here and a line in this ``__init__``.
"""

from amir_lightning.environments.base import Environment
from amir_lightning.environments.calculator import CalculatorEnvironment
from amir_lightning.environments.replies import ToolError
from amir_lightning.environments.tools import ToolEnvironment
from amir_lightning.environments.verifiers import VerifiersEnvironment

__all__ = ["CalculatorEnvironment", "Environment", "ToolEnvironment", "ToolError", "VerifiersEnvironment"]
