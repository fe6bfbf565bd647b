"""The ``amir`` command: LightningCLI subcommands over AmirGRPOModule and RolloutDataModule, and ``amir compare``.

amir fit --config configs/demo.yaml
amir validate --config configs/demo.yaml
amir fit --config configs/qwen.yaml --model.loss amir_lightning.objectives.GRPOLoss

``kill -USR1 <pid>`` prints the stack of every thread of a running ``amir`` to its stderr (a run that seems stuck
says where it waits).

Exit codes: 0 done, 1 a reward's or environment's own error, 2 bad input (one line naming the key or file), 3 a
server failed or stopped answering (its last output lines, then one line naming it, the route and the key), 130
Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import warnings

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.cli import ArgsType
from lightning.pytorch.utilities.exceptions import SIGTERMException

from amir_lightning.checkpoints.writing import CheckpointWriteError
from amir_lightning.cli.app import AmirCLI, build_cli, link_completion_length
from amir_lightning.environments.replies import EnvironmentStepError
from amir_lightning.helpers import stops
from amir_lightning.helpers.console import PipeSafeStdout, quiet_second_interrupt, user_traceback
from amir_lightning.helpers.http import ServerError
from amir_lightning.helpers.messages import user_message
from amir_lightning.helpers.preflight import check_config_files
from amir_lightning.loop.sync import StaleEngineError
from amir_lightning.models.export import HubPushError
from amir_lightning.rewards.base import RewardError

__all__ = ["AmirCLI", "build_cli", "link_completion_length", "main"]

#: Exceptions that mean "the input is wrong" (configuration, data files, paths, missing extras, a stale engine).
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    ModuleNotFoundError,
    StaleEngineError,
    CheckpointWriteError,  # the disk, named with the path and the space needed
    HubPushError,  # the trained policy is saved; its upload failed, and the message says how to push it again
    MisconfigurationException,  # Lightning's word for a bad trainer argument
)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``amir`` console script (LightningCLI subcommands, plus ``amir compare``)."""
    argv = list(args) if isinstance(args, list | tuple) else (sys.argv[1:] if args is None else None)
    if argv and argv[0] == "compare":
        from amir_lightning.evaluation.compare import main as compare_main

        return compare_main(argv[1:])
    if os.getcwd() not in sys.path:  # `class_path: my_rewards.X` and reward functions from where amir runs
        sys.path.insert(0, os.getcwd())
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when Ctrl-C is ignored (a background job)
        quiet_second_interrupt()
    if not isinstance(sys.stdout, PipeSafeStdout) and sys.stdout is not None:
        sys.stdout = PipeSafeStdout(sys.stdout)
    _stacks_on_sigusr1()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no disk sync
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The module's logged values are reduced over processes already (torchmetrics, or sync_dist). Lightning still
    # asks for sync_dist on one device whenever torch.distributed is up, as the in-process vLLM engine makes it.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(", category=PossibleUserWarning)
    restore = stops.catch_stop_signals(SIGTERMException)  # a request blocked on a server ends at SIGTERM or Ctrl-C
    try:
        _run(args, argv)
    finally:
        stops.request_stop("exit")  # a request still in flight on another thread must not hold the exit
        restore()


def _stacks_on_sigusr1() -> None:
    """``kill -USR1`` prints every thread's stack to stderr (unless SIGUSR1 has a handler, or stderr no file)."""
    if not hasattr(signal, "SIGUSR1") or signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a file descriptor
        pass


def _run(args: ArgsType, argv: list[str]) -> None:
    """The CLI, each way it can end turned into its exit code and one line."""
    try:
        check_config_files(argv or [])
        build_cli(args)
    except ServerError as err:  # the server's own last lines, then one line naming it, the route and the key
        if os.environ.get("AMIR_DEBUG"):
            raise
        tail = "".join(f"  {line}\n" for line in err.tail.splitlines())
        sys.stderr.write((f"its last output lines:\n{tail}" if tail else "") + f"amir: error: {err}\n")
        raise SystemExit(3) from None
    except USER_ERRORS as err:
        # Bad input is reported in one line that names the key or file; AMIR_DEBUG=1 shows the traceback.
        if os.environ.get("AMIR_DEBUG"):
            raise
        prefix = "trainer: " if isinstance(err, MisconfigurationException) else ""
        sys.stderr.write(f"amir: error: {prefix}{user_message(err)}\n(set AMIR_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None
    except (RewardError, EnvironmentStepError) as err:  # the user's code: its traceback, then one line naming it
        if os.environ.get("AMIR_DEBUG"):
            raise
        sys.stderr.write(user_traceback(err.__cause__) + f"amir: error: {err}\n")
        raise SystemExit(1) from None
    except SIGTERMException as err:  # preemption: a non-zero exit, so schedulers and `amir fit && ...` see it
        sys.stderr.write(f"amir: stopped by SIGTERM{getattr(err, 'amir_where', '')}\n")
        raise SystemExit(143) from None
    except KeyboardInterrupt:  # before or after the trainer runs (Lightning handles Ctrl-C while it does)
        sys.stderr.write("amir: interrupted\n")
        raise SystemExit(130) from None
    except SystemExit as err:  # Lightning's graceful Ctrl-C shutdown ends in exit 1, the code of a reward's error
        if err.code == 1 and stops.stop_reason() == "SIGINT":
            sys.stderr.write("amir: interrupted\n")
            raise SystemExit(130) from None
        raise
