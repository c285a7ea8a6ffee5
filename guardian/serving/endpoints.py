"""The handler's own endpoints: health, readiness, status, metrics, the models listing.

``Endpoints`` is a part of ``guardian.serving.handler.GuardianHandler``: its
``do_GET`` (and ``do_HEAD``). They read the served model (``ServedModel``,
guardian.serving.assembly): its engine, its stall detection (``/health``,
``/readyz``), its admission gate (the models' context lengths), its plugins
(``/metrics``), and the server's door and connections (``/guardian/status``).
"""

from __future__ import annotations

import urllib.parse

from guardian import stock
from guardian.admission.facts import context_length_of
from guardian.admission.model_access import listed_name
from guardian.errors import STOPPING_REASON, GuardianError
from guardian.serving.framing import asks_for_probes
from guardian.observability import metrics

# Polled by the supervisor, load balancers and Prometheus: their access
# lines are routine, at DEBUG (what they report is logged as it changes).
MONITORING_PATHS = frozenset({"/health", "/livez", "/readyz", "/guardian/status", "/metrics"})
# Every path do_GET answers (and /v1/models/<id>); the door's test walks them all.
GET_PATHS = (*sorted(MONITORING_PATHS), "/v1/models")


class Endpoints:
    """``GET`` and ``HEAD``: what monitoring reads, and ``/v1/models``."""

    def do_GET(self):
        path, _, query = self.path.partition("?")
        engine, stall_detector = self.response_generator.engine, self.response_generator.stall_detector
        if path == "/health":
            self.send_health(engine, stall_detector)
        elif path == "/livez":
            self.send_json(200, {"status": "ok"})
        elif path == "/readyz":
            self.send_readiness(engine, stall_detector, deep=asks_for_probes(query))
        elif path == "/guardian/status":
            live = getattr(self.response_generator, "live", None)
            config = {"config": live.status()} if live is not None else {}
            self.send_json(200, {**engine.status(), **stall_detector.status(), **config,
                                 "access": self.server.door.status(),
                                 "connections": self.server.connection_status()})
        elif path == "/metrics":
            self.send_metrics(metrics.registry_of(self.response_generator.pm))
        elif path in ("/v1/models", "/v1/models/"):  # stock lists them for both
            self.send_json(200, self.models_listing(engine.cli_args, self.response_generator.gate))
        elif path.startswith("/v1/models/"):
            self.send_model(path.removeprefix("/v1/models/"), engine.cli_args, self.response_generator.gate)
        else:
            self.send_method_not_allowed()

    def do_HEAD(self):
        """GET's answer without its body, where GET has one (load balancers' checks, curl -I)."""
        wfile = self.wfile
        self.wfile = HeadersOnly(wfile)
        try:
            self.do_GET()
        finally:  # socketserver's finish() reads and closes the connection's own
            self.wfile = wfile

    def send_metrics(self, registry) -> None:
        """Prometheus' text (guardian.observability.metrics); a 404 when the metrics plugin is disabled."""
        if registry is None:
            return self.send_unknown_path()
        body, content_type = metrics.exposition(registry, self.headers.get("Accept"))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def models_listing(self, cli_args, gate) -> dict:
        """Stock's listing with each model's ``context_length``, of the models a request may name
        (stock lists every model in the hub cache); no hub cache is no error."""
        listing = stock.models.models_listing(self)
        access = gate.model_access
        if access is not None and isinstance(listing.get("data"), list):
            listing["data"] = [model for model in listing["data"] if access.may_name(model.get("id"))]
        served_ids = {cli_args.model, listed_name(cli_args.model)} - {None}
        for model in listing.get("data", []):
            if model.get("id") in served_ids and gate.served_context_length:
                context_length = gate.served_context_length
            else:
                context_length = context_length_of(model.get("id", ""))
            if context_length is not None:
                model["context_length"] = context_length
        return listing

    def send_model(self, quoted_id: str, cli_args, gate) -> None:
        """OpenAI's retrieve: one model object, or 404 ``model_not_found``.

        Stock answers ``/v1/models/<id>`` with a list (filtered for hub
        models only, so always its own model), which the openai SDK's
        ``models.retrieve`` reads as a model with no id. The served model also
        answers to the names a request may give it: ``default_model`` and
        the ``--model`` as given.
        """
        model_id = urllib.parse.unquote(quoted_id)
        served_ids = {cli_args.model, listed_name(cli_args.model)} - {None}
        if model_id in ("default_model", cli_args.model):
            wanted = served_ids
        else:
            wanted = {model_id}
        for model in self.models_listing(cli_args, gate).get("data", []):
            if model.get("id") in wanted:
                return self.send_json(200, model)
        self.send_error_json(GuardianError(
            f"The model '{model_id}' does not exist", status=404,
            type="invalid_request_error", param="model", code="model_not_found",
        ))

    def send_health(self, engine, stall_detector) -> None:
        """Stock's path, truthful: 200 only while the engine can generate for a new request.
        From SIGTERM on it cannot (a new one gets 503 server_stopping): stock's only health
        path is the one a drop-in's load balancer checks, and it must take this replica out
        for the drain, as the supervisor's /health does."""
        if stall_detector.stopped:
            body = {"status": "unavailable", "state": engine.state.value, "reason": STOPPING_REASON}
            return self.send_json(503, body)
        healthy = engine.is_healthy and stall_detector.heartbeat_fresh()
        body = {"status": "ok" if healthy else "unavailable", "state": engine.state.value}
        self.send_json(200 if healthy else 503, body)

    def send_readiness(self, engine, stall_detector, deep: bool) -> None:
        if deep and engine.is_healthy and not stall_detector.progressing():
            stall_detector.run_probes_for_a_check()
        ready, reason = stall_detector.readiness()
        # Users' requests completed: a supervisor judges its restarts by them (progress).
        body = {"status": "ready" if ready else "unavailable", "reason": reason,
                "state": engine.state.value, "last_probe": stall_detector.status()["last_probe"],
                "requests_completed": engine.ledger.completed_for_users}
        self.send_json(200 if ready else 503, body)


class HeadersOnly:
    """A HEAD answer's output: the status line and headers (one write, by
    http.server's flush_headers), and nothing after them."""

    def __init__(self, wrapped):
        self.wrapped = wrapped
        self.headers_sent = False

    def write(self, data) -> int:
        if not self.headers_sent:
            self.headers_sent = bytes(data).endswith(b"\r\n\r\n")
            return self.wrapped.write(data)
        return len(data)

    def flush(self) -> None:
        self.wrapped.flush()
