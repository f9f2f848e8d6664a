"""`moepass chat`: a conversation on the terminal, in the model's chat template."""

from __future__ import annotations

import click

from moepass.cli.common import (
    STOP_OPTION,
    load_decoder,
    max_new_tokens_option,
    model_argument,
    require,
    runtime_options,
    sampling_of,
    sampling_options,
    template_variables,
    think_option,
    tokens_until_full,
)


@click.command()
@model_argument()
@click.option("--system", default=None, help="A system message that opens the conversation.")
@think_option
@max_new_tokens_option(1024, 1, "Tokens per answer at most")
@STOP_OPTION
@sampling_options(greedy=False)
@runtime_options
def chat(
    model_dir: str, system: str | None, think: bool | None, max_new_tokens: int, stop: tuple[str, ...], **options
) -> None:
    """Talk to the model in the terminal, turn after turn (the KV cache keeps the history).

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from moepass.serve.chat import chat_loop

    require("chat", "moepass chat", "jinja2")
    sampling = sampling_of(options)
    decoder = load_decoder(model_dir, options)
    if max_new_tokens == -1:
        max_new_tokens = tokens_until_full(decoder)
    chat_loop(decoder, system, template_variables(decoder, think), max_new_tokens, sampling, stop)
