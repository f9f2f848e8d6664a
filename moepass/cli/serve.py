"""`moepass serve`: the OpenAI- and llama-server-compatible HTTP server."""

from __future__ import annotations

import click

from moepass.cli.common import load_decoder, model_argument, require, runtime_options, stderr
from moepass.core.choices import (
    parse_bytes,
)


@click.command()
@model_argument()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option(
    "--api-key",
    default=None,
    envvar="MOEPASS_API_KEY",
    help="Require 'Authorization: Bearer KEY' (default: $MOEPASS_API_KEY; none: open).",
)
@click.option(
    "--queue",
    "queue_size",
    type=click.IntRange(0, None),
    default=8,
    show_default=True,
    help="Requests that may wait while every slot is answering; more get 503.",
)
@click.option(
    "--parallel",
    "-np",
    "parallel",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="Slots: requests generated at once, decoded together in one batch (llama-server's -np); "
    "each slot has its own KV cache.",
)
@click.option(
    "--max-body",
    default="8M",
    show_default=True,
    help="The largest request body taken (K, M, G); a larger one is answered 413 before it is read.",
)
@click.option(
    "--timeout",
    "body_seconds",
    type=click.FloatRange(0.1, None),
    default=30.0,
    show_default=True,
    help="Seconds a request's body may take to arrive; a slower one is answered 408.",
)
@click.option("--no-webui", "no_webui", is_flag=True, help="Serve no chat page at / (the API only).")
@runtime_options
def serve(model_dir: str, host: str, port: int, api_key: str | None, max_body: str, **options) -> None:
    """An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health) with
    llama-server's own endpoints (/completion, /props, /slots, /metrics) and a chat page at /.

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from pathlib import Path

    from moepass.serve.server import Limits, check_api_key, listen
    from moepass.serve.server import serve as run_server

    require("serve", "moepass serve", "fastapi", "uvicorn", "jinja2")
    check_api_key(api_key)  # before the port and the model
    body_limit = parse_bytes(max_body, "--max-body")
    limits = Limits(
        options.pop("parallel"),
        options.pop("queue_size"),
        body_limit,
        options.pop("body_seconds"),
        webui=not options.pop("no_webui"),
    )
    listener = listen(host, port)  # before the model loads: a busy port says so at once
    decoder = load_decoder(model_dir, options)
    given = Path(model_dir).resolve()  # a GGUF goes by its file's name, as in llama-server
    model_id = given.stem if given.suffix == ".gguf" else (given.parent if given.is_file() else given).name
    run_server(decoder, model_id, listener, api_key, echo=stderr, limits=limits)
