"""`moepass run`: generate from a prompt, with llama-cli's speed lines."""

from __future__ import annotations

import time

import click

from moepass.cli.common import (
    STOP_OPTION,
    load_decoder,
    max_new_tokens_option,
    model_argument,
    parse_ids,
    require,
    runtime_options,
    sampling_of,
    sampling_options,
    speed_lines,
    template_variables,
    think_option,
    tokens_until_full,
)
from moepass.core.terminal import for_stdout


@click.command()
@model_argument()
@click.option("-p", "--prompt", default=None, help="Prompt text (needs the tokenizer.json convert writes).")
@click.option(
    "-f",
    "--prompt-file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="Prompt text from a file ('-': standard input).",
)
@click.option("--prompt-ids", default=None, help="Prompt token ids, separated by commas or spaces (1,2,3).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the model's chat template.")
@click.option("--system", default=None, help="With --chat: a system message before it.")
@think_option
@max_new_tokens_option(16, 0, "Tokens to generate at most")
@STOP_OPTION
@sampling_options(greedy=True)
@runtime_options
def run(
    model_dir: str,
    chat: bool,
    system: str | None,
    think: bool | None,
    max_new_tokens: int,
    stop: tuple[str, ...],
    **options,
) -> None:
    """Generate: text in, text out (streamed), or token ids in, token ids out.

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    prompt, prompt_ids = _prompt_of(options)
    if (system is not None or think is not None) and not chat:
        raise click.UsageError("--system and --think/--no-think apply to --chat")
    if chat:
        require("chat", "--chat", "jinja2")
    sampling = sampling_of(options)
    decoder = load_decoder(model_dir, options)
    until_full = max_new_tokens == -1
    if until_full:
        max_new_tokens = tokens_until_full(decoder)
    start = time.perf_counter()
    if prompt is not None:
        text: str | list[int] = prompt
        if chat:
            variables = template_variables(decoder, think)
            text = decoder.encode_chat(decoder.apply_chat_template(prompt, system, **variables))
        stream = decoder.generate_text(text, max_new_tokens, sampling, stop)
        for piece in stream:
            click.echo(for_stdout(piece), nl=False)
        click.echo()
        count, ended = stream.completion_tokens, stream.ended_by
        timed = (stream.prefilled_tokens, stream.prompt_seconds, count, stream.generation_seconds)
    else:
        if stop:
            raise click.UsageError("--stop applies to text prompts; with --prompt-ids the output is token ids")
        tokens: list[int] = []
        ids = parse_ids(prompt_ids or "")
        first = 0.0
        for token in decoder.generate(ids, max_new_tokens, sampling=sampling):
            click.echo(f"{',' if tokens else ''}{token}", nl=False)  # as they come: an interrupt keeps them
            tokens.append(token)
            first = first or time.perf_counter()
        click.echo()
        count = len(tokens)
        ended = "the stop token" if tokens and tokens[-1] in decoder.stop_ids else "the token limit"
        timed = (len(ids), (first or start) - start, count, time.perf_counter() - (first or start))
    if until_full and ended == "the token limit":
        ended = f"the context ({decoder.context_length} tokens)"
    for line in speed_lines(*timed):
        click.echo(line, err=True)
    click.echo(
        f"{count} tokens in {time.perf_counter() - start:.3f} s on {decoder.plan.provider}, ended by {ended}", err=True
    )


def _prompt_of(options: dict) -> tuple[str | None, str | None]:
    """run's prompt (text, from --prompt or --prompt-file) or prompt ids, exactly one of them; their
    flags taken out of `options`."""
    prompt, prompt_file, prompt_ids = (options.pop(k) for k in ("prompt", "prompt_file", "prompt_ids"))
    if prompt_file is not None:
        if prompt is not None or prompt_ids is not None:
            raise click.UsageError("give one of --prompt, --prompt-file or --prompt-ids")
        prompt = prompt_file.read()
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT (or --prompt-file) or --prompt-ids 1,2,3")
    return prompt, prompt_ids
