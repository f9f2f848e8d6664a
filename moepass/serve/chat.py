"""`moepass chat`: a multi-turn conversation in the terminal, as llama-cli's conversation mode.

Each line typed is a user turn; the answer streams as it is generated, then one line on stderr
tells its speed and how many prompt tokens the turn had to compute (the KV cache keeps the
history, so a turn prefills only what is new). `/reset` forgets the history, `/clear` the history
and the KV cache (the system prompt kept), `/exit` (or Ctrl-D) leaves; another `/word` is named
as unknown, with the list. Ctrl-C stops the answer being written and returns to the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import click

from moepass.core.terminal import for_stdout

COMMANDS = {
    "/reset": "forget the conversation",
    "/clear": "forget the conversation and empty the KV cache (the system prompt stays)",
    "/exit": "leave (or Ctrl-D)",
    "/help": "this list",
}


def chat_loop(
    decoder,
    system: str | None,
    variables: dict,
    max_new_tokens: int,
    sampling,
    stop,
    read: Callable[[str], str] = input,
) -> None:
    """Turns until /exit or end of input; `variables` reach the template (e.g. enable_thinking)."""
    from moepass.runtime import ContextOverflow
    from moepass.runtime.conversation import Conversation

    decoder.chat_template  # noqa: B018 - no template: one clear error before the first prompt
    try:
        import readline  # noqa: F401 - line editing and history for input(), where the platform has it
    except ImportError:
        pass
    conversation = Conversation(decoder, system=system, **variables)
    click.echo(
        "type a message; /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops an answer", err=True
    )
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo(err=True)
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and " " not in text:  # a command (a message may start with a path)
            if _command(text, conversation):
                return
            continue
        start = time.perf_counter()
        stopped = ""
        try:
            for piece in conversation.say(line, max_new_tokens, sampling, stop):
                click.echo(for_stdout(piece), nl=False)
        except KeyboardInterrupt:
            stopped = "stopped; "
        except ContextOverflow as e:  # this turn is not sent; the conversation goes on as it was
            click.echo(f"(not sent: with this message {e}; /reset forgets the conversation)", err=True)
            continue
        seconds = time.perf_counter() - start
        stream = conversation.last
        click.echo()
        if stream is None:  # interrupted before the first token
            continue
        click.echo(_turn_speed(stream, seconds, stopped), err=True)


def _turn_speed(stream, seconds: float, stopped: str) -> str:
    """A turn's speed as llama-cli reports it: the tokens generated and their rate (the steps after
    the first token), the prompt's tokens, those computed (the rest the cache held) and their time
    and rate."""
    n, generation_s, prompt_s = stream.completion_tokens, stream.generation_seconds, stream.prompt_seconds
    rate = (n - 1) / generation_s if n > 1 and generation_s > 0 else n / seconds if seconds > 0 else 0.0
    computed = stream.prefilled_tokens
    prompt_rate = computed / prompt_s if prompt_s > 0 else 0.0
    return (
        f"[{stopped}{n} tokens, {rate:.1f} tokens/s; prompt {stream.prompt_tokens} tokens, {computed} computed in "
        f"{prompt_s * 1e3:.0f} ms ({prompt_rate:.1f} tokens/s)]"
    )


def _command(text: str, conversation) -> bool:
    """Runs the command `text` (one word, starting with "/"); whether the chat ends."""
    if text in ("/exit", "/quit"):
        return True
    if text == "/reset":
        conversation.reset()
        click.echo("(conversation forgotten)", err=True)
    elif text == "/clear":
        conversation.clear()
        click.echo("(conversation and KV cache cleared; the system prompt stays)", err=True)
    else:
        unknown = [] if text in ("/help", "/?") else [f"unknown command {text}"]
        click.echo("\n".join([*unknown, *(f"{c:<8} {what}" for c, what in COMMANDS.items())]), err=True)
    return False
