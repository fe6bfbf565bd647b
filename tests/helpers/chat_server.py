"""A local OpenAI-style chat server for the judge's tests: it answers what the test's ``reply`` function writes.

A judge that replies a given text (no score, then a score when asked again) is what these tests need, and no model
here writes it on demand; the server speaks the protocol over real HTTP and records each request's JSON body. Like
OpenAI's own API, a server that is not vLLM refuses a request carrying ``chat_template_kwargs`` (HTTP 400).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ChatServer:
    """Serves ``/v1/models`` (one model, ``judge``, owned by ``owned_by``) and ``/v1/chat/completions`` on 127.0.0.1.

    Args:
        reply: The reply's text from the request's body.
        owned_by: What ``/v1/models`` says owns the model (``vllm`` for a vLLM server).
    """

    def __init__(self, reply: Callable[[dict], str], owned_by: str = "vllm") -> None:
        self.reply, self.owned_by, self.bodies = reply, owned_by, []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                models = {"object": "list", "data": [{"id": "judge", "object": "model", "owned_by": server.owned_by}]}
                self._send(200, models if self.path == "/v1/models" else {})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                if "chat_template_kwargs" in body and server.owned_by != "vllm":
                    self._send(400, {"error": {"message": "Unrecognized request argument: chat_template_kwargs"}})
                    return
                message = {"role": "assistant", "content": server.reply(body)}
                self._send(200, {"object": "chat.completion", "choices": [{"index": 0, "message": message}]})

            def _send(self, code: int, answer: dict) -> None:
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        return Handler

    def __enter__(self) -> ChatServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
