"""The HTTP handler: stock's APIHandler, answering faults properly.

Stock answers any exception from the engine with a 404 and drops streams
without a word. This subclass lets stock parse, generate and format every
normal response, and steps in only when a request ends with an error:
an OpenAI-shaped body with the right status before any byte was sent, or
an SSE error event followed by ``[DONE]`` once a stream has started.
"""

from __future__ import annotations

import json
import time

import structlog

from guardian import stock
from guardian.context import request_scope
from guardian.errors import AbortRequest, GuardianError, from_stock_exception

log = structlog.get_logger("guardian.http")

_CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class GuardianHandler(stock.APIHandler):
    def handle_completion(self, request, stop_words):
        with self.server.completions, request_scope(self.request_id, bool(self.stream)):
            started = time.monotonic()
            try:
                super().handle_completion(request, stop_words)
            except AbortRequest as abort:
                self.send_error_json(abort.error)
            except _CLIENT_GONE:
                log.info("client_disconnected")
            except GuardianError as error:
                self.finish_with_error(error)
            except Exception as e:
                self.finish_with_error(from_stock_exception(e))
            finally:
                log.debug("request_finished", duration_ms=round((time.monotonic() - started) * 1000, 1))

    def finish_with_error(self, error: GuardianError) -> None:
        """End a request whose headers stock has prepared or sent."""
        if not self.stream:
            # Non-streaming headers wait in the buffer until the body is
            # ready: drop stock's 200 and answer with the error instead.
            self._headers_buffer = []
            self.send_error_json(error)
            return
        payload = json.dumps(error.body())
        try:
            self.wfile.write(f"data: {payload}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()
        except _CLIENT_GONE:
            return
        log.warning("stream_ended_with_error", status=error.status, code=error.code)

    def send_error_json(self, error: GuardianError) -> None:
        body = error.body_bytes()
        try:
            stock.set_completion_headers(self, error.status)
            for name, value in error.response_headers().items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except _CLIENT_GONE:
            return
        log.warning("request_rejected" if error.status < 500 else "request_errored",
                    status=error.status, code=error.code, error_message=error.message)

    def send_json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        stock.set_completion_headers(self, status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        engine = self.response_generator
        if path == "/health":
            healthy = engine.is_healthy
            self.send_json(
                200 if healthy else 503,
                {"status": "ok" if healthy else "unavailable", "state": engine.state.value},
            )
        elif path == "/livez":
            self.send_json(200, {"status": "ok"})
        elif path == "/guardian/status":
            self.send_json(200, engine.status())
        else:
            super().do_GET()

    def log_message(self, format, *args):
        # BaseHTTPRequestHandler writes access lines straight to stderr;
        # route them through structlog so every line is JSON.
        log.info("http_access", client=self.client_address[0], line=format % args)
