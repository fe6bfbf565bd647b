"""Fault injection for the resume tests: SIGKILL the training process in a chosen phase.

Importable by ``amir`` (the tests put this folder on PYTHONPATH) and selected by ``class_path``.
"""

import os
import signal

from lightning import Callback

from amir_lightning.checkpoints.writing import AtomicCheckpointIO
from amir_lightning.engines import VLLMEngine
from amir_lightning.rewards import MathAnswerReward


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillDuringRollout(VLLMEngine):
    """A vLLM engine that kills its process in the middle of the ``at_call``-th generation (1-based)."""

    def __init__(self, at_call: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.calls = at_call, 0

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.calls += 1
        if self.calls == self.at_call:
            super().generate(prompts[:1], n, sampling, seed)  # half of the work done, then the process dies
            _die()
        return super().generate(prompts, n, sampling, seed)


class SignalDuringRollout(VLLMEngine):
    """A vLLM engine that sends its own process ``signal`` (SLURM's USR1 warning, SIGTERM) as the ``at_call``-th
    generation (1-based) starts, then generates: the rollout is underway when the signal comes. (Generating part of
    it first would draw from the engine's random stream and change the rollout.)"""

    def __init__(self, at_call: int, signal_name: str = "SIGUSR1", **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.calls, self.signal = at_call, 0, getattr(signal, signal_name)

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.calls += 1
        if self.calls == self.at_call:
            os.kill(os.getpid(), self.signal)
        return super().generate(prompts, n, sampling, seed)


class KillBeforeOptimizerStep(Callback):
    """Kills the process when the optimiser is about to apply step ``at_step`` (its gradient is ready)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: D102
        if trainer.global_step == self.at_step:
            _die()


class KillDuringSave(AtomicCheckpointIO):
    """Writes half of the ``at_save``-th checkpoint's temporary file, then kills the process."""

    def __init__(self, at_save: int) -> None:
        super().__init__()
        self.at_save, self.saves = at_save, 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # noqa: D102
        self.saves += 1
        if self.saves == self.at_save:
            import io

            import torch

            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            target = os.fspath(path)
            tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{os.getpid()}")
            with open(tmp, "wb") as fh:
                fh.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            _die()
        super().save_checkpoint(checkpoint, path, storage_options)


class CtrlCDuringGrading(MathAnswerReward):
    """Presses Ctrl-C 50 ms into the ``at_call``-th grading: SIGINT to the whole process group, workers included.

    Only when this process leads its own group (the test starts it with a new session), so it never reaches the
    test runner.
    """

    def __init__(self, at_call: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.calls = at_call, 0

    def score(self, completions, answers):  # noqa: D102
        import threading

        self.calls += 1
        if self.calls == self.at_call:
            if os.getpgrp() != os.getpid():
                raise RuntimeError("CtrlCDuringGrading needs a process that leads its own process group")
            threading.Timer(0.05, os.killpg, (os.getpgrp(), signal.SIGINT)).start()
            big = list(completions) * 50  # long enough that the interrupt lands while the workers grade
            super().score(big, list(answers) * 50)
        return super().score(completions, answers)


class KillAfterShards(Callback):
    """Kills every process once it has written its shards of the ``at_save``-th distributed checkpoint (FSDP2),
    before Lightning writes the checkpoint's ``meta.pt`` beside them."""

    def __init__(self, at_save: int) -> None:
        self.at_save, self.saves = at_save, 0

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: D102
        import lightning.pytorch.strategies.model_parallel as model_parallel

        write_shards = model_parallel._distributed_checkpoint_save

        def save(state, path) -> None:
            write_shards(state, path)
            self.saves += 1
            if self.saves == self.at_save:
                _die()

        model_parallel._distributed_checkpoint_save = save


class FileSizeLimitFrom(Callback):
    """From rollout ``at_epoch`` (0-based) on, files this process writes may not grow past ``limit_bytes`` (the
    kernel's RLIMIT_FSIZE): a write over it fails with "File too large", as a full disk fails with "No space left"."""

    def __init__(self, at_epoch: int, limit_bytes: int) -> None:
        self.at_epoch, self.limit_bytes = at_epoch, limit_bytes

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: D102
        if trainer.current_epoch == self.at_epoch:
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit_bytes, resource.RLIM_INFINITY))


class CheckpointBeforeFirstStep(Callback):
    """Writes ``path`` as epoch ``epoch`` (0-based) starts: after it took its rollout, before its first step, where
    SLURM's requeue signal or a SIGTERM can come. The run goes on: it is also the uninterrupted run."""

    def __init__(self, epoch: int, path: str) -> None:
        self.epoch, self.path = epoch, path

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: D102
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
