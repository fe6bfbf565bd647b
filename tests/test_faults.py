"""Faults at run time, with the behaviour each must have: user code cannot change training, preemption is a clear
non-zero exit, bad rows are found when the data opens, and every message names its cause.

Most cases run ``amir fit`` in this process on ``configs/tiny.yaml`` with the HF engine (2 rollouts, a few seconds);
those that need a process of their own (SIGTERM, Ctrl-C, a file-size limit, a closed stdout) are in
``tests/e2e/test_stops.py``. A checkpoint folder that refuses writes is tried on the checkpoint writer alone, in a
small process of its own (a read-only mount, a folder's mode that root obeys once its override is dropped). The
reward functions are in ``tests/helpers/bad_rewards.py``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import amir_here
from safetensors.torch import load_file

ROOT = Path(__file__).parents[1]
HELPERS = Path(__file__).parent / "helpers"
TINY = str(ROOT / "configs" / "tiny.yaml")
HF = ["--data.engine", "amir_lightning.engines.HFEngine", "--data.engine.init_args.progress", "false"]
BASE = ["fit", "--config", TINY, "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "50"]
BASE += ["--trainer.deterministic", "true", *HF]
_CLEAN: dict[str, dict[str, torch.Tensor]] = {}


def fit_here(tmp_path, monkeypatch, capsys, extra, name="run") -> tuple[int, str]:
    """``amir fit`` of ``BASE`` in this process; (exit status, stderr)."""
    code, _, err = amir_here([*BASE, "--trainer.logger.init_args.name", name, *extra], tmp_path, monkeypatch, capsys)
    return code, err


def policy(tmp_path, name="run") -> dict[str, torch.Tensor]:
    return load_file(tmp_path / "runs" / name / "version_0" / "policy" / "model.safetensors")


def clean_weights(tmp_path_factory, monkeypatch, capsys) -> dict[str, torch.Tensor]:
    """The policy after 2 rollouts with ``bad_rewards.pure``, the reward every faulty one scores like."""
    if "pure" not in _CLEAN:
        folder = tmp_path_factory.mktemp("clean")
        code, err = fit_here(folder, monkeypatch, capsys, ["--data.rewards", "[bad_rewards.pure]"])
        assert code == 0, err[-2000:]
        _CLEAN["pure"] = policy(folder)
    return _CLEAN["pure"]


# (case, reward function, the warning it must get or None): the run must train exactly as with `pure`.
UNCHANGED = [
    ("reward drops the EOS token from completion_ids in place", "strips_eos_in_place", None),
    ("reward clears or rewrites every input it is given", "edits_every_input", None),
    ("reward changes the working directory", "changes_directory", "changed the working directory"),
    ("reward turns autograd off", "turns_grad_off", "changed the grad mode"),
    ("reward sets float64 as the default dtype", "sets_float64", "changed the default dtype"),
    ("reward changes torch's thread count", "takes_the_threads", "changed the thread count"),
]


@pytest.mark.parametrize(("case", "reward", "warning"), UNCHANGED, ids=[c[0] for c in UNCHANGED])
def test_user_code_cannot_change_training(case, reward, warning, tmp_path, tmp_path_factory, monkeypatch, capsys,
                                          caplog):  # fmt: skip
    clean = clean_weights(tmp_path_factory, monkeypatch, capsys)
    code, err = fit_here(tmp_path, monkeypatch, capsys, ["--data.rewards", f"[bad_rewards.{reward}]"])
    assert code == 0, err[-2000:]
    assert os.getcwd() == str(tmp_path) and torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
    weights = policy(tmp_path)
    for key in clean:
        assert torch.equal(clean[key], weights[key]), key
    if warning:
        assert sum(f"reward {reward} {warning}" in r.getMessage() for r in caplog.records) == 1  # once, not per call


TIMEOUT = (
    "[{class_path: amir_lightning.rewards.FunctionReward, init_args: {function: bad_rewards.sleeps, timeout_s: 0.2}}]"
)
# (case, data.rewards, exit status, fragments of stderr)
STOPS = [
    (
        "reward raises ValueError (int() of a completion)",
        "[bad_rewards.parses_digits]",
        1,
        ["amir: error: reward parses_digits (", "bad_rewards.py:", "raised ValueError: invalid literal for int()"],
    ),
    (
        "reward returns one number",
        "[bad_rewards.one_number]",
        2,
        ["reward one_number returned 0.5: expected a list of 128 scores, one per completion"],
    ),
    ("reward returns text", "[bad_rewards.text]", 2, ["reward text returned '1.0': expected a list of 128 scores"]),
    ("reward returns a dict", "[bad_rewards.a_dict]", 2, ["reward a_dict returned {'score': ["]),
    ("reward runs over its timeout_s", TIMEOUT, 1, ["reward sleeps ran longer than its timeout_s (0.2 s)"]),
    ("reward calls sys.exit(0)", "[bad_rewards.exits]", 1, ["amir: error: reward exits (", "raised SystemExit: 0"]),
    ("reward returns 3 scores for 128", "[bad_rewards.three_scores]", 2, ["returned 3 scores for 128 completions"]),
    (
        "reward returns a word among its numbers",
        "[bad_rewards.a_word_among_numbers]",
        2,
        ["reward a_word_among_numbers returned 'high' for completion 0: expected a number or None"],
    ),
]


@pytest.mark.parametrize(("case", "rewards", "status", "expected"), STOPS, ids=[c[0] for c in STOPS])
def test_a_failing_reward_stops_the_run_naming_it(case, rewards, status, expected, tmp_path, monkeypatch, capsys):
    code, err = fit_here(tmp_path, monkeypatch, capsys, ["--data.rewards", rewards])
    assert code == status, err[-2000:]
    for fragment in expected:
        assert fragment in err, err[-2000:]
    if status == 1 and "raised" in err:  # the user's own traceback, and none of ours
        assert 'bad_rewards.py", line' in err and f"in {rewards.split('.')[1].rstrip(']')}" in err
        assert "amir_lightning" not in err.split("amir: error:")[0]
    else:
        assert "Traceback" not in err


def test_a_slow_reward_is_reported_while_it_runs(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("AMIR_TEST_REWARD_SLEEP", "0.35")
    extra = ["--data.rewards", "[bad_rewards.sleeps]", "--trainer.max_epochs", "1"]
    extra += ["--data.rollout.reward_warn_s", "0.1"]
    code, err = fit_here(tmp_path, monkeypatch, capsys, extra)
    assert code == 0, err[-2000:]
    beats = [r.getMessage() for r in caplog.records if "reward sleeps has been running for" in r.getMessage()]
    assert len(beats) >= 2, beats  # every 0.1 s while it sleeps 0.35 s


def rows_file(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def digits(count=20):
    return [{"question": f"{i % 10}=", "answer": str(i % 10)} for i in range(count)]


def test_a_reference_column_of_another_name_is_refused_naming_the_columns(tmp_path, monkeypatch, capsys):
    """Before, every rollout had "no reward that applies" and the run exited 0 with a policy trained on nothing."""
    rows = [{"question": r["question"], "label": r["answer"]} for r in digits()]
    data = ["--data.prompts", "amir_lightning.data.JsonlPrompts", "--data.prompts.init_args.path"]
    code, err = fit_here(tmp_path, monkeypatch, capsys, [*data, rows_file(tmp_path, rows)])
    assert code == 2, err[-2000:]
    assert "MathAnswerReward grades against reference answers, but no training prompt of" in err
    assert "(its rows have the columns: label, question); name the answer column with" in err
    code, err = fit_here(tmp_path, monkeypatch, capsys, [*data, str(tmp_path / "rows.jsonl"),
                                                         "--data.prompts.init_args.answer_key", "label"])  # fmt: skip
    assert code == 0, err[-2000:]


BAD_ROWS = [
    ("empty user message", {"prompt": [{"role": "user", "content": "  "}], "answer": "3"}, "(an empty user message)"),
    ("lone surrogate", {"question": "7\ud8007=", "answer": "7"}, "(the tokenizer cannot encode it: TypeError"),
]


@pytest.mark.parametrize(("case", "row", "reason"), BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
@pytest.mark.parametrize("mode", ["error", pytest.param("skip", marks=pytest.mark.slow)])  # skip trains 2 rollouts
def test_rows_that_cannot_be_used_are_found_when_the_data_opens(case, row, reason, mode, tmp_path, monkeypatch,
                                                                capsys, caplog):  # fmt: skip
    """Before, the row passed the loader and broke the engine or the tokenizer when the stream reached it."""
    rows = digits()
    if "prompt" in row:  # a file of chat messages
        rows = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]
    rows[2] = row
    path = rows_file(tmp_path, rows)
    extra = ["--data.prompts", "amir_lightning.data.JsonlPrompts", "--data.prompts.init_args.path", path]
    code, err = fit_here(tmp_path, monkeypatch, capsys, [*extra, "--data.bad_prompts", mode])
    where = f"{path}:3 {reason}"
    if mode == "error":
        assert code == 2 and f"1 of 20 training prompts cannot be used: {where}" in err, err[-2000:]
        return
    assert code == 0, err[-2000:]
    assert any(f"skipping 1 of 20 training prompts that cannot be used: {where}" in r.getMessage()
               for r in caplog.records)  # fmt: skip


@pytest.mark.slow  # a vLLM engine that cannot start
def test_a_kv_cache_too_small_names_this_package_keys(tmp_path, monkeypatch, capsys):
    extra = ["--data.engine", "amir_lightning.engines.VLLMEngine", "--data.engine.init_args.max_model_len", "64"]
    extra += ["--data.engine.init_args.kv_cache_memory_bytes", "1024"]
    code, err = fit_here(tmp_path, monkeypatch, capsys, extra)
    line = next(line for line in err.splitlines() if line.startswith("amir: error:"))
    assert code == 2
    assert "the engine's KV cache does not fit: data.engine.init_args.kv_cache_memory_bytes 1024 leaves too" in line
    assert "gpu_memory_utilization" not in line.split("vLLM said")[0]


def test_a_checkpoint_cut_short_after_the_start_up_check_is_one_line(tmp_path):
    from amir_lightning.checkpoints.writing import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 3}, path)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError, match=r"last.ckpt could not be loaded \(RuntimeError: .*cut short"):
        AtomicCheckpointIO().load_checkpoint(path)


#: Saves a checkpoint of 400 KB at argv[1] in a process of its own and prints the CheckpointWriteError's line (any
#: other error is a traceback and exit 1). argv[2] "lock": the folder takes no new files from the moment the
#: checkpoint is being written (its file is open); argv[3]: the largest file the process may write (0: any).
_SAVE_IN_A_PROCESS = """
import os, resource, signal, sys
import torch
from amir_lightning.checkpoints.writing import AtomicCheckpointIO, CheckpointWriteError

path, lock, limit = sys.argv[1], sys.argv[2] == "lock", int(sys.argv[3])


class LocksTheFolder:
    def __reduce__(self):  # torch pickles the checkpoint once its file is open, before it writes the tensors
        os.chmod(os.path.dirname(path), 0o555)
        return int, (0,)


checkpoint = {"locked": LocksTheFolder()} if lock else {}
checkpoint["w"] = torch.zeros(100_000)
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    AtomicCheckpointIO().save_checkpoint(checkpoint, path)
except CheckpointWriteError as err:
    print(err)
"""


def _save_in_a_process(path: Path, lock: bool = False, limit: int = 0, wrapper: tuple = ()) -> str:
    """The one line ``_SAVE_IN_A_PROCESS`` prints. As root, the process runs without CAP_DAC_OVERRIDE, so a folder's
    mode holds for it as for any user (root writes into a 0o555 folder otherwise)."""
    as_a_user = ()
    if os.geteuid() == 0:
        as_a_user = ("setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override")
    command = [*wrapper, *as_a_user, sys.executable, "-c", _SAVE_IN_A_PROCESS, str(path), "lock" if lock else "-"]
    done = subprocess.run([*command, str(limit)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.slow  # a process of its own: about 6 s
def test_a_read_only_checkpoint_folder_is_one_line_naming_it(tmp_path):
    """The folder is a read-only file system (a tmpfs mounted read-only in a mount namespace of the process's own).
    Before: the clean-up's ``unlink`` of the temporary file that was never made raised EROFS in the handler, two
    chained tracebacks (rc 1 through ``amir fit``)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    namespace = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace[1:1] = ["--user", "--map-root-user"]
    mount = 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"'
    probe = subprocess.run([*namespace, "sh", "-c", mount, str(folder), "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no read-only file system can be mounted here: {probe.stderr.strip()}")
    line = _save_in_a_process(folder / "last.ckpt", wrapper=(*namespace, "sh", "-c", mount, str(folder)))
    assert line == (
        f"could not write the checkpoint {folder}/last.ckpt: the folder {folder} cannot be written to (Read-only file "
        "system); no partial file was left, no earlier checkpoint: give checkpoint.dirpath (or the logger's save_dir) "
        "a folder this run can write"
    )


@pytest.mark.slow  # a process of its own: about 6 s
def test_a_checkpoint_folder_without_write_permission_is_one_line_naming_it(tmp_path):
    """A folder of mode 0o555 holding an earlier checkpoint: the line names the folder and the cause, and says that no
    partial file was left (before: "the partial file was removed", and the space, where space was not the matter)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"global_step": 1}, folder / "epoch=0-step=1.ckpt")
    folder.chmod(0o555)
    try:
        line = _save_in_a_process(folder / "last.ckpt")
    finally:
        folder.chmod(0o755)
    assert line.startswith(
        f"could not write the checkpoint {folder}/last.ckpt: the folder {folder} cannot be written to (Permission "
        "denied); no partial file was left, the previous checkpoint is intact: give checkpoint.dirpath"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt"]


@pytest.mark.slow  # a process of its own: about 6 s
def test_a_partial_file_that_cannot_be_removed_does_not_hide_why_the_write_failed(tmp_path):
    """The folder takes no more files once the checkpoint's file is open, then the write fails (files may not grow
    past 50 KB, as on a full disk): the line gives the write's cause and says the partial file is still there. Before:
    the clean-up's PermissionError replaced "File too large", with two chained tracebacks."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    try:
        line = _save_in_a_process(folder / "last.ckpt", lock=True, limit=50_000)
        left = [p.name for p in folder.iterdir()]
    finally:
        folder.chmod(0o755)
    assert len(left) == 1 and left[0].startswith(".last.ckpt.tmp-"), left
    assert line.startswith(f"could not write the checkpoint {folder}/last.ckpt: File too large (")
    assert line.endswith(
        f"; the partial file {folder / left[0]} could not be removed (Permission denied), no earlier checkpoint"
    )


def test_characters_the_tokenizer_cannot_encode_are_reported_once(tmp_path, monkeypatch, capsys, caplog):
    """The tiny model's tokenizer knows only digits and ``=``: a letter used to vanish from the prompt unsaid."""
    rows = digits()
    rows[4]["question"] = "4=a"
    rows[9]["question"] = "9=b"
    path = rows_file(tmp_path, rows)
    extra = ["--data.prompts", "amir_lightning.data.JsonlPrompts", "--data.prompts.init_args.path", path]
    code, err = fit_here(tmp_path, monkeypatch, capsys, [*extra, "--trainer.max_epochs", "1"])
    assert code == 0, err[-2000:]
    said = [r.getMessage() for r in caplog.records if "characters the tokenizer cannot encode" in r.getMessage()]
    assert said == [
        "2 of 20 training prompts have characters the tokenizer cannot encode (dropped, or turned into its unknown "
        f"token), the first at {path}:5 ('a')"
    ]
