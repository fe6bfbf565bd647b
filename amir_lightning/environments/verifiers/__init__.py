"""A verifiers taskset as an environment: ``VerifiersEnvironment`` (``environment.py``).

``policy.py`` is the client verifiers samples through (our engine behind its OpenAI-shaped calls), ``scoring.py``
runs the taskset's rewards under a deadline, ``harness.py`` what verifiers imports to find our tasks. verifiers
itself is imported when an environment is built.
"""

from amir_lightning.environments.verifiers.environment import VerifiersEnvironment

__all__ = ["VerifiersEnvironment"]
