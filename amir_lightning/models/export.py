"""Writing the trained policy: a Hugging Face model directory (LoRA merged in) or a peft adapter directory.

Both are written atomically (a temporary directory, then a rename), so a reader never sees half an export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.files import atomic_directory
from amir_lightning.models.loading import full_state_dict, is_peft, is_sharded, merged_state


@dataclass
class HubSettings:
    """Where the final export goes on the Hugging Face Hub (``model.export.push_to_hub``).

    The token is huggingface_hub's own: ``HF_TOKEN`` or a ``hf auth login``.

    Attributes:
        repo_id: ``owner/name``; the repository is created when missing.
        private: Create it private.
        revision: A branch to push to (created when missing); ``None``: the default branch.
        commit_message: The commit's message.
    """

    repo_id: str
    private: bool = True
    revision: str | None = None
    commit_message: str = "Policy trained with amir-lightning (AMIR-GRPO)"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", self.repo_id or ""):
            raise ValueError(f"model.export.push_to_hub.repo_id must be owner/name, got {self.repo_id!r}")

    def push(self, folder: Path) -> str:
        """Upload ``folder`` (an export) and return the commit's address; an error names the folder to push again."""
        from huggingface_hub import HfApi

        api = HfApi()
        try:
            api.create_repo(self.repo_id, private=self.private, exist_ok=True)
            if self.revision is not None:
                api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
            commit = api.upload_folder(
                repo_id=self.repo_id, folder_path=str(folder), revision=self.revision,
                commit_message=self.commit_message,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - the export is safe on disk: say how to push it later
            raise HubPushError(
                f"model.export.push_to_hub: pushing {folder} to {self.repo_id} failed ({type(err).__name__}: "
                f"{str(err)[:200]}); the policy is saved there: push it with `hf upload {self.repo_id} {folder}`"
            ) from None
        return str(getattr(commit, "commit_url", commit))


class HubPushError(RuntimeError):
    """The push of an export to the Hub failed; the export itself is on disk."""


@dataclass
class ExportSettings:
    """Where and how the trained policy is written (``model.export``).

    Attributes:
        dir: Where the policy is written at the end of ``fit`` (default ``<log_dir>/policy``).
        every_n_epochs: Also export every this many rollouts, to ``<dir>_epoch_<n>`` (``None``: only at the end).
        format: ``merged`` (a Hugging Face model directory, LoRA merged in: what ``HFModel`` and vLLM load) or
            ``adapter`` (a peft adapter directory, LoRA only: megabytes instead of the whole model).
        push_to_hub: Also upload the final export to the Hugging Face Hub (``HubSettings``); ``None``: do not.
    """

    dir: str | None = None
    every_n_epochs: int | None = None
    format: Literal["merged", "adapter"] = "merged"
    push_to_hub: HubSettings | None = None

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "model.export.every_n_epochs", self.every_n_epochs, ge=1, optional=True)
        if self.format not in ("merged", "adapter"):
            errors.append(f"model.export.format must be merged or adapter, got {self.format!r}")
        raise_errors(errors)

    def root(self, log_dir: str | None) -> Path:
        """Where the final export goes: ``dir``, or ``<log_dir>/policy``."""
        return Path(self.dir or Path(log_dir or ".") / "policy")

    def due(self, rollouts_done: int, max_rollouts: int | None) -> bool:
        """Whether a rollout-end export is due (``every_n_epochs``); the last rollout's is the final export."""
        every = self.every_n_epochs
        return bool(every) and rollouts_done % every == 0 and rollouts_done != max_rollouts

    def save(self, model, tokenizer, target: Path, write: bool = True) -> None:
        """Write ``model`` and ``tokenizer`` to ``target`` in ``format``; every process calls, ``write`` ones save."""
        (export_adapters if self.format == "adapter" else export_policy)(model, tokenizer, target, write)


def export_policy(model, tokenizer, target: Path, write: bool = True) -> None:
    """Save ``model`` (LoRA merged, gathered if sharded) with ``tokenizer`` as a Hugging Face directory, atomically.

    Every process calls it when the model is sharded (the gather is collective); only ``write`` ones save.
    """
    with merged_state(model) as named:
        state = {k: v.detach().cpu().contiguous() for k, v in named}
    if not write:
        return
    base = model.get_base_model() if is_peft(model) else model
    if is_sharded(base):  # a sharded module cannot save itself: a plain model of its config takes the state
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_config(base.config)
    with atomic_directory(target) as tmp:
        base.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)


def export_adapters(model, tokenizer, target: Path, write: bool = True) -> None:
    """Save the LoRA adapters of ``model`` as a peft adapter directory (``PeftModel.from_pretrained`` loads it).

    Every process calls it when the model is sharded (the gather is collective); only ``write`` ones save.
    """
    if not is_peft(model):
        raise ValueError("model.export.format: adapter needs model.lora (the whole policy trains: export merged)")
    from peft import get_peft_model_state_dict

    state = {k: v.detach().cpu().contiguous() for k, v in full_state_dict(model).items() if "lora_" in k}
    if not write:
        return
    adapters = get_peft_model_state_dict(model, state_dict=state)
    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp, state_dict=adapters)
        tokenizer.save_pretrained(tmp)
