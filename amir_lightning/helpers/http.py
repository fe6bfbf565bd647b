"""JSON requests to a server, watched: a deadline, the server's process checked, and a stop that ends them at once.

Each request runs in its caller's thread on a socket of its own, which one watcher thread per process sees every
half second. It ends a request past its deadline, and every request to a server whose process (one this run started)
is gone; it says in one line when a server has not answered for ``SAY_AFTER_S`` (60 s), or sooner when its process is
stopped (SIGSTOP) with requests waiting, with the state of the process. A stop (SIGTERM, Ctrl-C:
``helpers/stops.py``) shuts every socket in flight, so the caller raises what the run makes of that signal at once.
Every failure is a ``ServerError``: one line naming the server, the route and the setting to look at. Requests go to
the server directly, never through a cluster's HTTP proxy.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from amir_lightning.helpers import stops

log = logging.getLogger(__name__)

SAY_AFTER_S = 60.0  # a request unanswered this long is said, with the state of its server's process
STOPPED_SAY_S = 5.0  # sooner when that process is stopped
SAY_AGAIN_S = 300.0  # the same state is said again after this long
TICK_S = 0.5
CONNECT_S = 10.0


class ServerError(RuntimeError):
    """A server failed or stopped answering: the message is one line naming it, the route and the setting to look at.

    Args:
        message: That line.
        tail: The last lines of the server's output (a server this run started), shown above it.
        transient: Whether asking again may work (a 5xx answer, a connection reset).
    """

    def __init__(self, message: str, tail: str = "", transient: bool = False) -> None:
        super().__init__(message)
        self.tail, self.transient = tail, transient


@dataclass
class Endpoint:
    """A server requests go to, and how its failures are named.

    Attributes:
        url: Its address (``http://host:port``).
        what: Its name in messages (``the vLLM server``).
        url_key: The setting of its address (``data.engine.init_args.url``).
        expect: What that address must be (``a vLLM server started as ...``), said of a wrong answer.
        absent: What to do when nothing listens there.
        process: The ``ServerProcess`` this run started for it (``None``: started elsewhere).
        headers: Sent with every request (an API key).
    """

    url: str
    what: str
    url_key: str
    expect: str
    absent: str
    process: Any = None
    headers: dict[str, str] = field(default_factory=dict)


def request(endpoint: Endpoint, route: str, body: dict | None = None, *, deadline_s: float, deadline_key: str,
            method: str = "POST", plain: bool = False) -> dict:  # fmt: skip
    """``body`` as JSON to ``endpoint.url + route``; the answer's JSON object.

    ``plain``: ``{"text": the answer's text}``, for a route that answers in words.

    ``deadline_s`` (the setting ``deadline_key``) bounds the wait. Raises ``ServerError``, or what a stop raises.
    """
    stops.raise_if_stopped()
    exchange = _Exchange(endpoint, route, deadline_s, deadline_key)
    _WATCHER.add(exchange)
    try:
        status, kind, text = exchange.run(method, {} if body is None and method == "POST" else body)
    except (OSError, http.client.HTTPException) as err:
        raise _failure(exchange, err) from None
    finally:
        _WATCHER.remove(exchange)
    return _decode(endpoint, route, status, kind, text, plain)


@contextmanager
def reading(endpoint: Endpoint, route: str, answer: dict) -> Iterator[dict]:
    """``answer`` for the block to read: a ``ServerError`` naming what it lacks where it lacks what the block reads."""
    try:
        yield answer
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise ServerError(
            f"{endpoint.what} at {endpoint.url} answered {route} without what it must send ({type(err).__name__}: "
            f"{err}; it sent {one_line(json.dumps(answer), 160)}): {endpoint.url_key} must be {endpoint.expect}"
        ) from None


def health(url: str, timeout: float = 5.0) -> str:
    """``ok`` when ``url`` answers ``/health`` with 200, else ``refused``, ``silent`` or the status it answers."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/health")
        status = conn.getresponse().status
    except ConnectionRefusedError:
        return "refused"
    except (OSError, http.client.HTTPException):
        return "silent"
    finally:
        conn.close()
    return "ok" if status == 200 else str(status)


def one_line(text: str | bytes, limit: int = 300) -> str:
    """``text`` on one line, cut at ``limit`` characters."""
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(endpoint: Endpoint) -> str:
    """The state of a server's process in words (``its process 12 is stopped (state T: SIGSTOP or a debugger)``)."""
    process = endpoint.process
    state = process.state() if process is not None else ""
    if state == "stopped":
        return f"its process {process.pid} is stopped (state T: SIGSTOP or a debugger)"
    if state == "gone":
        return f"its process {process.pid} is gone ({process.exit_text()})"
    answers = health(endpoint.url, timeout=2.0) == "ok"
    who = f"its process {process.pid} is alive" if process is not None else "it was not started by this run"
    return f"{who} and {'answers /health (busy)' if answers else 'does not answer /health either'}"


class _Exchange:
    """One request: its socket (which ``abort`` shuts from another thread) and why it was ended, if it was."""

    def __init__(self, endpoint: Endpoint, route: str, deadline_s: float, deadline_key: str) -> None:
        self.endpoint, self.route, self.deadline_s, self.deadline_key = endpoint, route, deadline_s, deadline_key
        self.started, self.deadline = time.monotonic(), time.monotonic() + deadline_s
        self.aborted: str | None = None  # deadline, gone, or a stop's reason
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def abort(self, reason: str) -> None:
        with self.lock:
            self.aborted = self.aborted or reason
            sock = self.sock
        if sock is not None:
            try:  # wakes the thread blocked reading it (closing it would not)
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self, method: str, body: dict | None) -> tuple[int, str, bytes]:
        parts = urlsplit(self.endpoint.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname, parts.port, timeout=min(CONNECT_S, self.deadline_s))
        try:
            conn.connect()
            with self.lock:
                self.sock = conn.sock
            if self.aborted:
                raise ConnectionAbortedError(self.aborted)
            conn.sock.settimeout(self.deadline_s + 5.0)  # the watcher ends it at the deadline; this, if it cannot
            data = None if body is None else json.dumps(body).encode()
            headers = {**({"Content-Type": "application/json"} if data is not None else {}), **self.endpoint.headers}
            conn.request(method, parts.path.rstrip("/") + self.route, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheader("Content-Type") or "", response.read()
        finally:
            conn.close()


def _failure(exchange: _Exchange, err: BaseException) -> BaseException:
    """What a request that raised ``err`` (or was ended by the watcher or a stop) raises."""
    endpoint, route, reason = exchange.endpoint, exchange.route, exchange.aborted
    where, process = f"{endpoint.what} at {endpoint.url}", endpoint.process
    if reason not in (None, "deadline", "gone"):
        return stops.interruption(reason)
    if reason == "gone" or (process is not None and process.gone_within(1.0)):
        process.close()  # what it started (its engine core) goes with it
        return ServerError(f"{where} died while answering {route} ({process.exit_text()}; its output: "
                           f"{process.log_path})", tail=process.log_tail())  # fmt: skip
    tail = process.log_tail() if process is not None else ""
    if reason == "deadline" or isinstance(err, TimeoutError):  # a stopped server's output says nothing of it
        state = describe(endpoint)
        return ServerError(f"{where} did not answer {route} within {exchange.deadline_s:g} s "
                           f"({exchange.deadline_key}); {state}", tail="" if "stopped" in state else tail)  # fmt: skip
    if isinstance(err, ConnectionRefusedError):
        return ServerError(f"no server at {endpoint.url} (connection refused at {route}); {endpoint.absent}")
    return ServerError(f"{where} did not answer {route}: {type(err).__name__}: {err}", tail=tail, transient=True)


def _decode(endpoint: Endpoint, route: str, status: int, kind: str, text: bytes, plain: bool = False) -> dict:
    where = f"{endpoint.what} at {endpoint.url}"
    if status == 404:
        raise ServerError(f"{where} has no route {route} (404): {endpoint.url_key} must be {endpoint.expect}")
    if status >= 400:
        tail = endpoint.process.log_tail() if endpoint.process is not None and status >= 500 else ""
        raise ServerError(f"{where} refused {route} ({status}): {one_line(text, 600)}", tail=tail,
                          transient=status >= 500 or status == 429)  # fmt: skip
    if plain:
        return {"text": text.decode(errors="replace")}
    if not text.strip():
        return {}
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        what = "JSON that is not an object" if answer is not None else f"{kind.split(';')[0] or 'text'}, not JSON"
        raise ServerError(f"{where} answered {route} with {what} ({one_line(text, 80)!r}): {endpoint.url_key} must "
                          f"be {endpoint.expect}")  # fmt: skip
    return answer


class _Watcher:
    """The thread that sees every request in flight: deadlines, servers gone or stopped, a stop asked for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[_Exchange] = set()
        self.said: dict[str, tuple[float, str, float]] = {}  # url -> what was last said of it
        self.thread: threading.Thread | None = None
        stops.on_stop(self.abort_all)

    def add(self, exchange: _Exchange) -> None:
        with self.lock:
            self.live.add(exchange)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="server-watch", daemon=True)
                self.thread.start()
        if stops.stop_reason():  # asked between the caller's check and now
            exchange.abort(stops.stop_reason())

    def remove(self, exchange: _Exchange) -> None:
        with self.lock:
            self.live.discard(exchange)

    def abort_all(self, reason: str) -> None:
        with self.lock:
            live = list(self.live)
        for exchange in live:
            exchange.abort(reason)

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the watcher must outlive a failed probe
                log.debug("server watch", exc_info=True)

    def _tick(self) -> None:
        now = time.monotonic()
        with self.lock:
            live = list(self.live)
        servers: dict[str, list[_Exchange]] = {}
        for exchange in live:
            servers.setdefault(exchange.endpoint.url, []).append(exchange)
            if now > exchange.deadline:
                exchange.abort("deadline")
        for url in set(self.said) - set(servers):
            del self.said[url]
        for waiting in servers.values():
            process = waiting[0].endpoint.process
            if process is not None and process.state() == "gone":
                for exchange in waiting:
                    exchange.abort("gone")
            else:
                self._say(waiting, now)

    def _say(self, waiting: list[_Exchange], now: float) -> None:
        """Say a server that has not answered for a while, with its process's state; again when that changes."""
        oldest = min(waiting, key=lambda e: e.started)
        endpoint, age = oldest.endpoint, now - oldest.started
        stopped = endpoint.process is not None and endpoint.process.state() == "stopped"
        if age < (STOPPED_SAY_S if stopped else SAY_AFTER_S):
            self.said.pop(endpoint.url, None)
            return
        last = self.said.get(endpoint.url)  # when it was said, what, and when /health was last asked
        if last is not None and ("stopped" in last[1]) == stopped and now - last[2] < SAY_AFTER_S:
            return
        state = describe(endpoint)
        if last is not None and last[1] == state and now - last[0] < SAY_AGAIN_S:
            self.said[endpoint.url] = (last[0], state, now)
            return
        self.said[endpoint.url] = (now, state, now)
        count = f" ({len(waiting)} requests waiting)" if len(waiting) > 1 else ""
        log.log(logging.INFO if "(busy)" in state else logging.WARNING,
                "%s at %s has not answered %s for %.0f s%s; %s; it has %g s (%s), or stops at SIGTERM",
                endpoint.what, endpoint.url, oldest.route, age, count, state, oldest.deadline_s,
                oldest.deadline_key)  # fmt: skip


_WATCHER = _Watcher()
