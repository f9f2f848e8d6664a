"""What the commands share: options (runtime, sampling, model, threads), the progress display, the
loading of a model (a GGUF through the cache) and the speed lines."""

from __future__ import annotations

import collections
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import click
from click.core import ParameterSource

from moepass.core import keys
from moepass.core.choices import (
    DEFAULT_DRAFT_TOKENS,
    DEVICES,
    PLUGIN_ENV,
    format_bytes,
    format_rate,
)
from moepass.core.errors import MoepassError, no_such_path
from moepass.core.options import Option
from moepass.core.sampling import LLAMA_SERVER, Sampling


class Progress:
    """Progress on stderr, its length learned from the first report: a bar on a terminal; elsewhere
    (a log file, CI) a line every LOG_EVERY seconds and one at the end, with what is done, the rate
    and the time left. `unit`: "bytes" (sizes in MiB/GiB, the rate in MB/s or GB/s) or a noun counted
    as it is ("prompts")."""

    LOG_EVERY = 5.0

    def __init__(self, label: str, enabled: bool, unit: str = "bytes"):
        self.label, self.enabled, self.unit = label, enabled, unit
        self.bar: Any = None  # click's progress bar, made at the first report on a terminal
        self.ended = False  # the bar reached the whole and its line was ended
        self.tty = sys.stderr.isatty()
        self.start = self.last = 0.0  # from the first report: the rate of the work itself
        self.done = self.total = 0

    def _amount(self, n: float) -> str:
        return format_bytes(n) if self.unit == "bytes" else f"{int(n)}"

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if not self.start:
            self.start = self.last = time.monotonic()
        self.done, self.total = done, total
        if self.tty:
            self._bar(done, total)
            return
        now = time.monotonic()
        if now - self.last >= self.LOG_EVERY or (done >= total and self.last != -1):
            self.last = now if done < total else -1
            click.echo(self.line(now), err=True)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate else float("inf")
        what = f"{self._amount(self.done)} of {self._amount(self.total)}" + (
            "" if self.unit == "bytes" else f" {self.unit}"
        )
        speed = format_rate(rate) if self.unit == "bytes" else f"{rate:.1f} {self.unit}/s"
        eta = (
            "done" if self.done >= self.total else f"{left:.0f} s left" if math.isfinite(left) else "time left unknown"
        )
        return f"{self.label}: {what} ({self.done / max(self.total, 1):.0%}), {speed}, {eta}"

    def _bar(self, done: int, total: int) -> None:
        """The terminal's bar, its line ended at its last update (the next message starts on a line
        of its own); a report of the whole again after that draws nothing."""
        if self.bar is None:
            if done >= total and self.ended:
                return
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr, show_pos=self.unit != "bytes")
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)
        if done >= total:
            self.close()
            self.ended = True

    def close(self) -> None:
        """Ends the bar's line (once; nothing where there is no bar)."""
        bar, self.bar = self.bar, None
        if bar is not None:
            bar.__exit__(None, None, None)


def parse_ids(text: str) -> list[int]:
    from moepass.profile import token_ids

    return token_ids(text, "--prompt-ids")


def _finite_option(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A float option that must be a finite number (click's FloatRange lets nan and inf through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", param=param)
    return value


def declared(options: Iterable[Option]) -> Callable:
    """The click options of `options` (moepass.core.options), in their order: each passes its value
    under its Python keyword, so the command hands them to the API as they are."""
    made = [_click_option(o) for o in options]

    def apply(f: Callable) -> Callable:
        for option in reversed(made):
            f = option(f)
        return f

    return apply


def _click_option(o: Option) -> Callable:
    if o.kind in ("switch", "off"):  # "off": the flag gives False, its absence True
        return click.option(*o.flags, o.name, is_flag=True, flag_value=o.kind == "switch", default=o.kind == "off",
                            show_default=False, help=o.help)  # fmt: skip
    kind: Any = (
        click.Choice(list(o.choices))
        if o.choices
        else click.IntRange(o.low, o.high)
        if o.kind == "int"
        else click.Path(dir_okay=False)
        if o.kind == "path"
        else None
    )
    return click.option(
        *o.flags,
        o.name,
        type=kind,
        default=o.default,
        show_default=o.shown if o.shown is not None else True,
        metavar=o.metavar,
        help=o.help,
    )


def threads_option(shown: str, help: str) -> Callable:
    """-t/--threads: a count of threads, at least 1 (default None: `shown`)."""
    return click.option("-t", "--threads", type=click.IntRange(1, None), default=None, show_default=shown, help=help)


def bandwidth_option(flag: str, shown: str | float, help: str) -> Callable:
    """A bandwidth in GB/s for partition's estimate: finite, None where not given (the estimate then
    takes the --gpu card's figure or the default, and says which figures were given). `shown`: a
    phrase for the default, or the default figure itself, shown as the other options show theirs."""
    if isinstance(shown, str):
        return click.option(flag, type=float, callback=_finite_option, default=None, show_default=shown, help=help)
    return click.option(flag, type=float, callback=_given_option, default=f"{shown:g}", show_default=True, help=help)


def _given_option(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A finite float option, None where it was not given (its default only shown in the help)."""
    value = _finite_option(ctx, param, value)
    return None if param.name is None or ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT else value


def model_argument(name: str = "model_dir", metavar: str = "MODEL") -> Callable:
    """A command's one model: the argument `metavar`, or llama.cpp's -m/--model PATH in its place
    (exactly one of the two); the command receives it as `name` either way."""

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            kwargs[name] = _one_model(kwargs.pop(name), kwargs.pop("model_flag"), metavar)
            return f(*args, **kwargs)

        command = click.option(
            "-m",
            "--model",
            "model_flag",
            metavar=metavar,
            type=click.Path(),
            default=None,
            help=f"The model as llama.cpp's -m takes it, in place of {metavar} (default: the {metavar} argument).",
        )(command)
        return click.argument(name, metavar=metavar, type=click.Path(), required=False)(command)

    return decorate


def _one_model(positional: str | None, flag: str | None, metavar: str) -> str:
    """The model given as the argument or as -m/--model: one of them, once."""
    ctx = click.get_current_context(silent=True)
    if positional is not None:
        if flag is not None:
            raise click.UsageError(f"give {metavar} once: as the argument ({positional}) or -m ({flag}), not both", ctx)
        return positional
    if flag is None:
        raise click.UsageError(f"missing {metavar}: give it as the argument or as -m {metavar}", ctx)
    return flag


CACHE_DIR_OPTION = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="For a GGUF MODEL: where its conversion is kept (default: $MOEPASS_CACHE, else "
    "$XDG_CACHE_HOME/moepass, else ~/.cache/moepass).",
)


def runtime_options(f):
    """Options shared by run, chat, serve and bench: where and how the model is loaded."""
    for option in reversed(
        [
            click.option(
                "--device",
                type=click.Choice(DEVICES),
                default="auto",
                show_default=True,
                help="auto: the best EP available (CUDA, else WebGPU, else the CPU); cuda, webgpu: fail unless "
                "that EP and a device are there (webgpu: pip install 'moepass[webgpu]').",
            ),
            click.option(
                "--cuda-plugin",
                type=click.Path(dir_okay=False),
                default=None,
                help=f"ONNX Runtime CUDA plugin EP library (default: ${PLUGIN_ENV}).",
            ),
            CACHE_DIR_OPTION,
            click.option(
                "--offload",
                "mode",
                type=click.Choice(keys.OFFLOAD_MODES),
                default=None,
                help="Expert offload: disabled, auto (fall back with a warning) or required "
                "(default: what partition wrote).",
            ),
            threads_option("ONNX Runtime's: every core", "ONNX Runtime intra-op threads."),
            click.option(
                "--speculative",
                default=None,
                metavar="ngram|draft:PATH",
                show_default="off: one token per step",
                help="Speculative decoding: drafts from n-gram lookup in the context, or from a smaller "
                "converted model with the same vocabulary; the output is the model's own.",
            ),
            click.option(
                "--draft-tokens",
                type=click.IntRange(1, 64),
                default=DEFAULT_DRAFT_TOKENS,
                show_default=True,
                help="With --speculative: draft tokens checked per step.",
            ),
            click.option(
                "-c",
                "--ctx-size",
                type=click.IntRange(0, None),
                default=0,
                show_default=True,
                help="The context to run with (tokens: the prompt and what is generated; the KV cache holds "
                "no more), at most the one the model was converted for (convert --context N); 0: all of it.",
            ),
            *_placed_by_partition(),
        ]
    ):
        f = option(f)
    return f


# llama.cpp's flags that place layers or tensors on the GPU as the model loads: moepass places them
# ahead of time, with partition; each spelling its own hidden option, so that the answer names the
# flag typed (and click matches -ngl whole, not as -n gl)
LLAMA_PLACEMENT_FLAGS = (  # its spellings, and whether it takes a value
    (("-ngl", "--n-gpu-layers", "--gpu-layers"), True),
    (("-ncmoe", "--n-cpu-moe"), True),
    (("-ot", "--override-tensor"), True),
    (("-cmoe", "--cpu-moe"), False),  # every MoE layer's experts on the CPU
)


def _placed_by_partition() -> list[Callable]:
    """Hidden options for LLAMA_PLACEMENT_FLAGS, each refused in one line naming moepass's way."""
    return [
        click.option(
            flag,
            is_flag=not takes_value,
            default=None if takes_value else False,
            hidden=True,
            expose_value=False,
            callback=_refuse_placement,
        )
        for spellings, takes_value in LLAMA_PLACEMENT_FLAGS
        for flag in spellings
    ]


def _refuse_placement(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is None or value is False:
        return
    typed = param.opts[0] + ("" if value is True else f" {value}")
    raise click.UsageError(
        f"{typed}: moepass places layers ahead of time, not as it loads: `moepass partition MODEL --target layers "
        "--vram SIZE` puts whole MoE layers on the GPU or the CPU (what llama.cpp's -ngl / --n-cpu-moe / -ot "
        f"choose), then `moepass {ctx.info_name} PLACED/` runs the placed folder",
        ctx,
    )


def load_settings(options: dict) -> dict:
    """The keyword arguments of moepass.runtime.load among the CLI's options (taken out of them)."""
    names = ("device", "cuda_plugin", "mode", "threads", "speculative", "draft_tokens")
    return {n: options.pop(n) for n in names}


def echo_placement(decoder) -> None:
    """Where ONNX Runtime put the MoE layers of a per-layer plan, and the nodes of a session on an EP
    that takes only some (WebGPU): its graph assignment record."""
    if decoder.moe_placement:
        counts = collections.Counter(decoder.moe_placement.values())
        click.echo("MoE layers: " + ", ".join(f"{n} on {ep}" for ep, n in sorted(counts.items())), err=True)
    if decoder.node_placement:
        from moepass.runtime.providers import placement_summary

        click.echo(placement_summary(decoder.node_placement), err=True)


def sampling_options(greedy: bool):
    """Sampling options shared by run, chat and serve, as llama.cpp names them; the defaults are
    greedy decoding (run) or llama-server's (chat, serve)."""
    d = Sampling() if greedy else LLAMA_SERVER

    def decorate(f):
        f = click.option(
            "-s",
            "--seed",
            type=click.IntRange(-1, 2**64 - 1),
            default=None,
            show_default="random",
            help="Seed for sampled decoding; -1: a random one, said on stderr (llama.cpp's spelling).",
        )(f)
        for flag, kind, text in reversed(SAMPLING_OPTIONS):  # the last applied is shown first
            finite = kind is float or isinstance(kind, click.FloatRange)
            f = click.option(
                flag,
                *LLAMA_SPELLINGS.get(flag, ()),
                _field(flag),
                type=kind,
                default=getattr(d, _field(flag)),
                show_default=True,
                callback=_finite_option if finite else None,
                help=text,
            )(f)
        return f

    return decorate


# run, chat and serve's sampling options as llama.cpp names them: flag (its Sampling field), values, meaning
SAMPLING_OPTIONS = (
    ("--temperature", click.FloatRange(0, None), "0 = greedy."),
    ("--top-k", click.IntRange(0, None), "Keep the K likeliest tokens (0 = no limit)."),
    (
        "--top-p",
        click.FloatRange(0, 1, min_open=True),
        "Keep the likeliest tokens up to this probability mass (1 = all).",
    ),
    ("--min-p", click.FloatRange(0, 1), "Drop tokens less likely than this times the likeliest."),
    (
        "--repeat-penalty",
        click.FloatRange(0, None, min_open=True),
        "Divide the logits of tokens among the last --repeat-last-n (1 = off).",
    ),
    ("--repeat-last-n", click.IntRange(0, None), "Tokens of the context the penalties look back over."),
    ("--presence-penalty", float, "Subtracted from the logit of every token seen."),
    ("--frequency-penalty", float, "Subtracted from a token's logit once per time it was seen."),
)

# llama.cpp's other names for the same options, where they differ from moepass's
LLAMA_SPELLINGS = {"--temperature": ("--temp",)}


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


def sampling_of(options: dict) -> Sampling:
    names = [_field(flag) for flag, _, _ in SAMPLING_OPTIONS] + ["seed"]
    settings = {n: options.pop(n) for n in names}
    if settings["seed"] == -1:  # llama.cpp's "random seed": drawn here and said, so a run can be repeated
        import secrets

        settings["seed"] = secrets.randbits(32)
        click.echo(f"random seed {settings['seed']} (-s {settings['seed']} repeats this run)", err=True)
    return Sampling(**settings)


def require(extra: str, what: str, *modules: str) -> None:
    """An extra's packages, checked before the model loads (not after a minute of loading)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MoepassError(f"{what} needs {', '.join(missing)}: pip install 'moepass[{extra}]'")


def converted(model: str, options: dict) -> str:
    """MODEL itself, or for a GGUF file its conversion, made once into the cache (said in one line)."""
    from moepass.gguf_cache import resolve, resolve_draft

    cache_dir = options.pop("cache_dir")
    if not os.path.exists(model):  # said before "loading ...", as convert and inspect say it
        raise no_such_path(model)
    # a bar on a terminal; a log a line every LOG_EVERY seconds (a conversion takes minutes)
    progress = Progress(f"converting {os.path.basename(model)}", enabled=True)

    def say(line: str) -> None:
        progress.close()  # a bar still drawn: its line ended first
        stderr(line)

    try:
        folder = resolve(model, cache_dir, echo=say, progress=progress)
    finally:
        progress.close()
    if options.get("speculative"):
        options["speculative"] = resolve_draft(options["speculative"], cache_dir, echo=stderr)
    return str(folder)


def speed_lines(prompt_n: int, prompt_s: float, generated: int, generation_s: float) -> list[str]:
    """The speed of a generation as llama-cli prints it: the prompt's computation (to the first
    token), then the tokens after the first, one step each."""
    lines = []
    for what, n, unit, seconds in (("prompt eval", prompt_n, "tokens", prompt_s),
                                   ("eval", max(generated - 1, 0), "runs", generation_s)):  # fmt: skip
        if n and seconds > 0:
            lines.append(
                f"{what:<11} {seconds * 1e3:9.2f} ms / {n:5d} {unit:<6} ({seconds * 1e3 / n:8.2f} ms per token, "
                f"{n / seconds:8.2f} tokens per second)"
            )
    return lines


def stderr(line: str) -> None:
    click.echo(line, err=True)


def load_decoder(model_dir: str, options: dict):
    """The model as run, chat and serve load it (a partitioned model with its placement; a GGUF
    through the cache)."""
    from moepass.runtime import load

    given, model_dir = model_dir, converted(model_dir, options)
    context = context_size(given, model_dir, options.pop("ctx_size"))
    start = time.perf_counter()
    click.echo(f"loading {model_dir} ...", err=True)
    decoder = load(model_dir, **load_settings(options))
    click.echo(f"loaded in {time.perf_counter() - start:.1f} s on {decoder.plan.provider}", err=True)
    run_within(decoder, context)
    echo_placement(decoder)
    if decoder.speculator is not None:
        click.echo(decoder.speculator.describe(), err=True)
    return decoder


def context_size(given: str, model_dir: str, ctx_size: int) -> int | None:
    """-c/--ctx-size, checked before the model loads against the context `model_dir` (the model
    `given`, or its conversion) was converted for (None: that one, -c 0)."""
    if not ctx_size:
        return None
    from moepass.core.formats import read_report
    from moepass.core.model_io import model_file

    built = read_report(model_file(model_dir).parent).context_length
    if built and ctx_size > built:
        gguf = given if given.endswith(".gguf") else "MODEL.gguf"
        raise MoepassError(
            f"-c {ctx_size}: {given} was converted for a context of {built} tokens; for more, convert it "
            f"for them: `moepass convert {gguf} -o OUT --context {ctx_size}`, then run OUT"
        )
    return ctx_size


def run_within(decoder, context: int | None) -> None:
    """Run the loaded model within -c's context: the decoder's context length bounds each request
    (a prompt that fills it is refused, generation stops at it) and the KV cache, which grows to it
    and no further."""
    if context:
        decoder.context_length = context
        decoder.context_limit = f"-c {context}"


def max_new_tokens_option(default: int, least: int, text: str) -> Callable:
    """-n/--max-new-tokens: at least `least`, or llama.cpp's -1: until the stop token or a full context."""

    def check(ctx: click.Context, param: click.Parameter, value: int) -> int:
        if value < least and value != -1:
            raise click.BadParameter(
                f"{value} is not a count of tokens: give at least {least}, or -1 (until the stop token or the "
                "context is full)"
            )
        return value

    return click.option(
        "-n",
        "--max-new-tokens",
        type=int,
        default=default,
        show_default=True,
        callback=check,
        help=f"{text}; -1: until the stop token or the context is full.",
    )


def tokens_until_full(decoder) -> int:
    """-n -1: the tokens to ask for (the context's), each request then given as many as the context
    has room for after its prompt, without the warning that a request was cut (this one asked to be)."""
    context = decoder.context_length
    if not context:
        raise click.UsageError("-n -1 generates until the context is full; this model records no context: give -c N")
    decoder.until_full = True
    return context


def think_option(f):
    return click.option(
        "--think/--no-think",
        default=None,
        help="Turn the template's reasoning switch on or off (Qwen3's enable_thinking).",
    )(f)


def template_variables(decoder, think: bool | None) -> dict:
    """The template's reasoning switch as --think/--no-think set it; a template without one: a
    warning line, and the chat goes on as the template has it."""
    if think is None:
        return {}
    switch = decoder.chat_template.thinking_switch
    if switch is None:
        click.echo(
            f"moepass: warning: {decoder.chat_template.where}: this chat template has no thinking switch; "
            f"--{'' if think else 'no-'}think is ignored",
            err=True,
        )
        return {}
    return {switch: think}


STOP_OPTION = click.option(
    "--stop", multiple=True, help="Stop when the text reaches this string (repeatable); not shown."
)
