"""The ``amir`` process on a terminal: a second Ctrl-C, a closed pipe, and the user's own traceback.

Used by ``amir_lightning.cli``; nothing here knows of Lightning or of training.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import traceback

from typing_extensions import override


def quiet_second_interrupt() -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` once (Lightning's graceful shutdown); a second one ends the process.

    Pressed before that shutdown starts ignoring Ctrl-C, the second one used to interrupt whatever ran, and
    garbage-collection callbacks and exit handlers printed "Exception ignored ... KeyboardInterrupt" tracebacks.
    Now it exits at once with one line.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    pressed = []

    def handle(signum, frame) -> None:
        pressed.append(signum)
        if len(pressed) == 1:
            raise KeyboardInterrupt
        sys.stderr.write("amir: interrupted again, exiting now\n")
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, handle)


class PipeSafeStdout(io.TextIOBase):
    """``sys.stdout`` that outlives its reader.

    Once the pipe closes (``amir fit ... | head``), output goes to ``/dev/null`` and the run goes on. Python would
    raise ``BrokenPipeError`` from the next print (a progress bar's, for one) and end the run.
    """

    def __init__(self, stream) -> None:
        self.stream = stream

    @override
    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    @override
    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    @property
    @override
    def closed(self) -> bool:
        return self.stream.closed  # the stream it writes to is what can close

    @override
    def isatty(self) -> bool:
        return self.stream.isatty()

    @override
    def fileno(self) -> int:
        return self.stream.fileno()

    def _drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # what is left in the old stream's buffer, and child processes, write nowhere
        os.close(devnull)
        self.stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def user_traceback(err: BaseException | None) -> str:
    """The traceback of ``err`` from its first frame outside this package: the user's code, as Python prints it."""
    if err is None:
        return ""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # amir_lightning/
    tb = err.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))
