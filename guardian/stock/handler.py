"""Stock's HTTP handler and ``main()``: the CORS grant the door decides, stock's flags parsed by
stock's parser.
"""

from __future__ import annotations

import argparse
from typing import Callable

import mlx_lm.server as server

from guardian.stock.contract import APIHandler


class DoorCorsHandler(APIHandler):
    """Stock's handler, its CORS headers the door's (the subclass's ``cors_headers()``).

    Stock grants ``Access-Control-Allow-Origin: *`` unless ``--allowed-origins``
    says otherwise; the guardian grants only what the door allows (by default
    pages on this machine), with stock's other two headers
    (guardian.access.policy.AccessPolicy.cors_headers).
    """

    def cors_headers(self) -> dict:  # pragma: no cover - the subclass's
        raise NotImplementedError

    def _set_cors_headers(self):
        for name, value in self.cors_headers().items():
            self.send_header(name, value)


def set_completion_headers(handler, status_code: int) -> None:
    """Status line, JSON content type and stock's CORS headers."""
    handler._set_completion_headers(status_code)


def run_stock_main(
    run: Callable,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    after_parse: Callable[[argparse.Namespace], None],
):
    """Run stock ``main()``: stock parses its flags, then calls ``run``.

    Stock builds its parser inside ``main()``; the guardian adds its own
    flags to that very parser just before it parses, so ``--help`` shows
    both and every stock flag keeps its name, default and meaning.
    ``after_parse`` sees the flags before stock builds its ModelProvider.
    """
    stock_parse_args = argparse.ArgumentParser.parse_args
    extended = set()

    def parse_args_with_guardian_flags(parser, *args, **kwargs):
        if id(parser) not in extended:
            extended.add(id(parser))
            add_arguments(parser)
        namespace = stock_parse_args(parser, *args, **kwargs)
        after_parse(namespace)
        return namespace

    saved_run = server.run
    server.run = run
    argparse.ArgumentParser.parse_args = parse_args_with_guardian_flags
    try:
        return server.main()
    finally:
        argparse.ArgumentParser.parse_args = stock_parse_args
        server.run = saved_run
