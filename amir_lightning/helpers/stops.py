"""A stop the run was asked for (SIGTERM, Ctrl-C), seen at once by code that waits on a server.

Lightning's SIGTERM handler only sets a flag that its loops read between batches, and Ctrl-C raises in the main
thread alone: a request blocked on a server (in the main thread, on a pool's threads, or sampling the next rollout
ahead) would wait out its deadline. ``catch_stop_signals`` adds a handler that records the stop and tells every
listener (``helpers/http.py`` shuts the sockets of the requests in flight), so each one ends in the exception the run
already turns into its exit: the SIGTERM exception it names (``amir`` names Lightning's ``SIGTERMException``: exit
143, one line naming the checkpoint) or ``KeyboardInterrupt``. Nothing here imports Lightning.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

_stop: list[str] = []  # the reason, once asked: SIGTERM, SIGINT, or "exit" (the run is ending)
_listeners: list[Callable[[str], None]] = []
_sigterm: list[type[BaseException]] = [SystemExit]  # what a request interrupted by SIGTERM raises


def request_stop(reason: str) -> None:
    """Record a stop (``SIGTERM``, ``SIGINT`` or ``exit``) and tell every listener."""
    if not _stop:
        _stop.append(reason)
    for listener in list(_listeners):
        listener(reason)


def stop_reason() -> str | None:
    """The stop asked for (``None``: none)."""
    return _stop[0] if _stop else None


def on_stop(listener: Callable[[str], None]) -> None:
    """Call ``listener(reason)`` at each stop request (from the signal handler: it must not block)."""
    _listeners.append(listener)


def interruption(reason: str) -> BaseException:
    """The exception a request interrupted by ``reason`` raises: what the run makes of that signal."""
    if reason == "SIGTERM":
        return _sigterm[0]() if _sigterm[0] is not SystemExit else SystemExit(143)
    if reason == "SIGINT":
        return KeyboardInterrupt()
    return RuntimeError("the run is ending: the request was abandoned")


def is_stop(err: BaseException) -> bool:
    """Whether ``err`` is what a stop asked for raises (not an error of the code it went through)."""
    return bool(_stop) and isinstance(err, (_sigterm[0], KeyboardInterrupt))


def raise_if_stopped() -> None:
    """Raise ``interruption`` of the stop asked for, if any."""
    if _stop:
        raise interruption(_stop[0])


def catch_stop_signals(sigterm: type[BaseException] = SystemExit) -> Callable[[], None]:
    """Record SIGTERM and Ctrl-C as stops (Lightning's own handlers still run); returns what puts the old ones back.

    A request interrupted by SIGTERM raises ``sigterm()`` (``SystemExit(143)`` by default). While Lightning's trainer
    runs, its SIGTERM handler calls this one after its own. Outside it (the engine starting, the export after the
    fit), SIGTERM raises it in the main thread, so it still ends in exit 143 with the servers this run started
    stopped, not in the default kill that skips ``atexit``.
    """
    _stop.clear()
    _sigterm[0] = sigterm
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    def on_term(signum, frame) -> None:
        request_stop("SIGTERM")
        if signal.getsignal(signal.SIGTERM) is on_term:  # not called by Lightning's handler: nothing else acts on it
            raise interruption("SIGTERM")

    def on_int(signum, frame) -> None:
        request_stop("SIGINT")
        if callable(old_int):
            old_int(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    if callable(old_int):  # not where Ctrl-C is ignored (a background job)
        signal.signal(signal.SIGINT, on_int)

    def restore() -> None:
        _stop.clear()
        _sigterm[0] = SystemExit
        signal.signal(signal.SIGTERM, old_term)
        if signal.getsignal(signal.SIGINT) is on_int:
            signal.signal(signal.SIGINT, old_int)

    return restore
