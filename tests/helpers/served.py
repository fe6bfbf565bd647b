"""vLLM servers that the runs of the test files using the ``served`` fixture share, reached as a user reaches a server
they started (``data.engine.init_args.url``); each test process keeps its own, from one such file to the next.

A server's start costs about 17 s of CPU here (vLLM imported twice: the API server and its engine core). A run pushes
its weights in full at its first sync (``Sampler.push``), so runs in turn can share one server of their model's
architecture and tokenizer. An engine's start asks the server for one token before any push, so a test that leaves
a server with broken weights (a torn push, a NaN) pushes whole ones again before it ends. What a server's own process
does (started by the run, the first training process
starting it for the others, stopped with the run, hung, killed) is tested on servers the runs start themselves.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import yaml

from amir_lightning.engines import VLLMServerEngine

ROOT = Path(__file__).parents[2]
#: The tests' server settings: the tiny model's context, a 32 MiB KV cache, one thread.
SETTINGS = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}


class Served:
    """Servers started at their first use, one per model architecture and tokenizer, closed by ``close``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.engines: dict[str, VLLMServerEngine] = {}

    def url(self, model_dir, lora_rank: int | None = None) -> str:
        """The address of a server of ``model_dir``'s architecture and tokenizer (its weights: the last run's);
        ``lora_rank``: one that serves pushed adapters of that rank (``push_adapters``)."""
        from amir_lightning.models import LoraSettings

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config.pop("_name_or_path", None)
        tokenizer = model_dir / "tokenizer.json"
        identity = json.dumps(config, sort_keys=True).encode() + tokenizer.read_bytes() + str(lora_rank).encode()
        key = hashlib.sha256(identity).hexdigest()[:16]
        if key not in self.engines:
            # a test's folder may go before the server
            kept = model_dir if self.folder in model_dir.parents else shutil.copytree(model_dir, self.folder / key)
            engine = VLLMServerEngine(**SETTINGS, push_adapters=lora_rank is not None)
            engine.take_adapters(LoraSettings(r=lora_rank) if lora_rank is not None else None)
            engine.start(kept, seed=0)
            self.engines[key] = engine
        return self.engines[key].url

    def tiny_url(self) -> str:
        """The address of a server of ``build_tiny_model``'s model (whatever its seed)."""
        from amir_lightning.models import build_tiny_model

        model = self.folder / "tiny"
        return self.url(model if (model / "config.json").is_file() else build_tiny_model(model, seed=0))

    def tiny_yaml_engine(self, lora_rank: int | None = None) -> str:
        """``--data.engine``'s value for the server engine at a server of configs/tiny.yaml's model; ``lora_rank``:
        one that serves the adapters of a LoRA policy of that rank (``push_adapters``)."""
        from amir_lightning.models import TinyModel

        policy = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["model"]["policy"]
        model = TinyModel(**policy["init_args"], cache_dir=str(self.folder / "models")).resolve()
        given = {"url": self.url(model, lora_rank), "max_model_len": SETTINGS["max_model_len"]}
        if lora_rank is not None:
            given["push_adapters"] = True
        return json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": given})

    def close(self) -> None:
        """Stop every server (a later ``url`` starts its own)."""
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
