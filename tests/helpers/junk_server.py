"""A local HTTP server that is not the server a run expects, for the fault tests of the server engine and the judge.

``mode`` says how it answers every route but ``/health`` (which answers 200, as a proxy or another server would):
``html`` a 200 HTML page (a proxy's login page), ``json`` 200 with JSON of other fields, ``404`` no such route (a
vLLM server without the RL routes), ``500`` an internal error, ``silent`` never (it reads the request and waits).
The routes in ``good`` answer as a server should: ``/v1/models`` lists a model ``judge`` served by vLLM.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("html", "json", "404", "500", "silent")
GOOD = {"/v1/models": b'{"object": "list", "data": [{"id": "judge", "object": "model", "owned_by": "vllm"}]}'}


class JunkServer:
    """Serves on 127.0.0.1 as ``mode`` says (the routes in ``good`` excepted), counting the requests of each route."""

    def __init__(self, mode: str, good: tuple[str, ...] = ()) -> None:
        assert mode in MODES, mode
        self.mode, self.good, self.requests = mode, good, {}
        self.release = threading.Event()  # ends the silent waits
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self._answer()

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer()

            def _answer(self) -> None:
                route = self.path.split("?")[0]
                server.requests[route] = server.requests.get(route, 0) + 1
                if route == "/health":
                    return self._send(200, "text/plain", b"")
                if route in server.good:
                    return self._send(200, "application/json", GOOD[route])
                if server.mode == "silent":
                    server.release.wait(600)
                    return None
                if server.mode == "html":
                    return self._send(200, "text/html", b"<html><body>Please sign in</body></html>")
                if server.mode == "json":
                    return self._send(200, "application/json", b'{"status": "ok", "data": []}')
                code = int(server.mode)
                return self._send(code, "application/json", b'{"detail": "Not Found"}' if code == 404 else b"oops")

            def _send(self, code: int, kind: str, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        return Handler

    def __enter__(self) -> JunkServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
