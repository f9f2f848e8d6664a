"""The moepass command line: convert, inspect, run, chat, serve, bench, profile, merge-profiles, partition.

Bad input ends with one line `moepass: error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from moepass.core import keys
from moepass.core.choices import (
    ACTIVATION_MODES,
    BYTES_RULE,
    DEFAULT_DRAFT_TOKENS,
    DEVICES,
    EXPERT_FORMATS,
    FLOAT_EXPERT_CHOICES,
    KV_CACHE_TYPES,
    MAX_CONTEXT,
    PLAN_MODES,
    PLUGIN_ENV,
    POLICIES,
    PRINT_AFTER_CHOICES,
    PROMPT_FORMATS,
    TARGETS,
    format_bytes,
    parse_bytes,
)
from moepass.core.errors import CLI_WORDING, MoepassError, expected_failure, no_such_path, worded_as
from moepass.core.gpus import GPU_PRESETS, Bandwidths
from moepass.core.sampling import LLAMA_SERVER, Sampling
from moepass.core.terminal import for_stdout

# `moepass --help` lists the commands in the order a model goes through them
PIPELINE_ORDER = ("convert", "inspect", "profile", "merge-profiles", "partition", "run", "chat", "serve", "bench",
                  "cache")  # fmt: skip


class _Group(click.Group):
    """The CLI boundary: every expected failure becomes one line and exit status 2, an interrupt
    (SIGINT, SIGTERM) exit 130/143 after the running command removed what it had half-written,
    and anything else, a bug, keeps its traceback and says so. Its help lists the commands in
    PIPELINE_ORDER, each with its whole first sentence."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        known = super().list_commands(ctx)
        return [c for c in PIPELINE_ORDER if c in known] + [c for c in known if c not in PIPELINE_ORDER]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, **extra):
        extra.pop("standalone_mode", None)
        try:
            previous = signal.signal(signal.SIGTERM, _terminated)
        except ValueError:  # not the main thread (an embedding application): its own signal handling stays
            previous = None
        handler = _WarningLine()
        logging.getLogger("moepass").addHandler(handler)
        try:
            with worded_as(CLI_WORDING):  # the messages' ways out as flags (--force), not keywords
                code = super().main(args, prog_name, standalone_mode=False, **extra)
            sys.exit(code if isinstance(code, int) else 0)
        except click.exceptions.NoArgsIsHelpError as e:  # `moepass` alone: the help, as --help gives it
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.ClickException as e:
            option = f"{e.param_hint}: " if isinstance(e, click.BadParameter) and e.param_hint else ""
            message = e.message if option else e.format_message()
            hint = f" (see '{e.ctx.command_path} --help')" if isinstance(e, click.UsageError) and e.ctx else ""
            click.echo(f"moepass: error: {option}{message}{hint}", err=True)
            sys.exit(2)
        except (click.Abort, KeyboardInterrupt):
            click.echo(f"moepass: interrupted{_NOTHING_LEFT if _writes(args) else ''}", err=True)
            sys.exit(130)
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001 - the one place failures are worded
            message = expected_failure(e)
            if message is None:
                traceback.print_exc()
                click.echo(
                    f"moepass: this is a bug in moepass {_version()} ({type(e).__name__}); please report it "
                    "with the traceback above",
                    err=True,
                )
                sys.exit(1)
            click.echo(f"moepass: error: {message}", err=True)
            sys.exit(2)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            logging.getLogger("moepass").removeHandler(handler)


class _WarningLine(logging.Handler):
    """The library's warnings (logger "moepass") as `moepass: warning: ...` lines on stderr."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"moepass: warning: {record.getMessage()}", err=True)


_NOTHING_LEFT = "; nothing half-written was left"
WRITING_COMMANDS = ("convert", "partition", "profile", "merge-profiles")


def _writes(args) -> bool:
    """Whether the command line runs a command that writes files (whose interruption says so)."""
    words = [a for a in (sys.argv[1:] if args is None else args) if not a.startswith("-")]
    return bool(words) and words[0] in WRITING_COMMANDS


def _terminated(signum, frame):
    click.echo(f"moepass: terminated{_NOTHING_LEFT if _writes(None) else ''}", err=True)
    sys.exit(128 + signum)  # SystemExit unwinds through every cleanup (atomic outputs remove their temporaries)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moepass")
    except PackageNotFoundError:
        return "(not installed)"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="moepass")
def main() -> None:
    """Turn Mixture-of-Experts GGUF models into ONNX decoders with com.microsoft::QMoE experts."""


class _Progress:
    """Progress on stderr, its length learned from the first report: a bar on a terminal; elsewhere
    (a log file, CI) a line every LOG_EVERY seconds and one at the end, with what is done, the rate
    and the time left. `unit`: "bytes" (shown in MB/GB) or a noun counted as it is ("prompts")."""

    LOG_EVERY = 5.0

    def __init__(self, label: str, enabled: bool, unit: str = "bytes"):
        self.label, self.enabled, self.unit = label, enabled, unit
        self.bar: Any = None  # click's progress bar, made at the first report on a terminal
        self.ended = False  # the bar reached the whole and its line was ended
        self.tty = sys.stderr.isatty()
        self.start = self.last = 0.0  # from the first report: the rate of the work itself
        self.done = self.total = 0

    def _amount(self, n: float) -> str:
        if self.unit != "bytes":
            return f"{int(n)}"
        return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"

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
        speed = f"{self._amount(rate)}/s" if self.unit == "bytes" else f"{rate:.1f} {self.unit}/s"
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


def _parse_ids(text: str) -> list[int]:
    from moepass.profile import token_ids

    return token_ids(text, "--prompt-ids")


def _finite_option(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A float option that must be a finite number (click's FloatRange lets nan and inf through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", param=param)
    return value


def _threads_option(shown: str, help: str) -> Callable:
    """-t/--threads: a count of threads, at least 1 (default None: `shown`)."""
    return click.option("-t", "--threads", type=click.IntRange(1, None), default=None, show_default=shown, help=help)


def _bandwidth_option(flag: str, shown: str | float, help: str) -> Callable:
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


def _model_argument(name: str = "model_dir", metavar: str = "MODEL") -> Callable:
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


@main.command()
@_model_argument("model")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(file_okay=True),
    help="Directory to create for model.onnx, model.onnx.data and moepass.json.",
)
@click.option(
    "--float-experts",
    type=click.Choice(FLOAT_EXPERT_CHOICES),
    default="keep",
    show_default=True,
    help="F32/F16/BF16 experts: keep as float (com.microsoft::MoE) or quantize into QMoE.",
)
@click.option(
    "--expert-format",
    type=click.Choice(EXPERT_FORMATS),
    default="auto",
    show_default=True,
    help="auto: the exact form when the experts move bit-exactly (Q4_0, Q8_0, IQ4_XS, MXFP4, ...), "
    "else 8 bits at the largest block (keeps llama.cpp's fidelity); int4: 4 bits (half the bytes, "
    "more error), int8: 8 bits; offload: what ONNX Runtime's expert offload takes "
    "(int4 block 32 prepacked, float16 graph); packed: the GGUF's own blocks as they are, in MoEPacked "
    "nodes (CUDA only: no CPU kernel runs them).",
)
@click.option(
    "--exact",
    is_flag=True,
    help="Keep the exact form of every tensor whose blocks move bit-exactly, even where a requantized "
    "form is faster (Q6_K: int8 block 16 instead of block 128).",
)
@_threads_option("every core", "Threads converting weights.")
@click.option(
    "--activations",
    type=click.Choice(list(ACTIVATION_MODES)),
    default="int8",
    show_default=True,
    help="int8: quantized to 8 bits inside each quantized matmul, as llama.cpp does (ONNX Runtime "
    "accuracy_level 4; fast). float: exact float arithmetic on the weights (slower; for tests).",
)
@click.option(
    "--imatrix",
    type=click.Path(dir_okay=False),
    default=None,
    help="llama.cpp importance matrix (GGUF or .dat): weighs requantization errors per input column.",
)
@click.option(
    "--force", is_flag=True, help="Replace the output directory if moepass wrote it (never a folder of yours)."
)
@click.option(
    "-c",
    "--context",
    type=click.IntRange(1, MAX_CONTEXT),
    default=None,
    show_default="the GGUF's context_length",
    help="Positions (tokens) the model is built for: its RoPE tables.",
)
@click.option(
    "--allow-non-finite",
    is_flag=True,
    help="Convert tensors holding NaN or Inf (refused by default: the model would compute NaN logits).",
)
@click.option(
    "--print-after",
    type=click.Choice(PRINT_AFTER_CHOICES),
    default=None,
    help="Print the graph after this step (GGUF: lower, then its passes; ONNX: read, fuse-moe, ...).",
)
@click.option(
    "--genai-speculative",
    default=None,
    metavar="ngram|draft:PATH",
    show_default="off",
    help="Write speculative decoding into genai_config.json for onnxruntime-genai (PATH: the draft "
    "model's converted folder); moepass run/chat/serve take --speculative when they run.",
)
@click.option(
    "--draft-tokens",
    type=click.IntRange(1, 16),
    default=DEFAULT_DRAFT_TOKENS,
    show_default=True,
    help="With --genai-speculative: draft tokens per step.",
)
@click.option(
    "--kv-cache",
    type=click.Choice(list(KV_CACHE_TYPES)),
    default="float32",
    show_default=True,
    help="The KV cache's type: float16 halves it, int8 quarters it (per-channel scales calibrated on the "
    "model's own keys and values).",
)
@click.option(
    "--kv-calibration",
    type=click.Path(dir_okay=False),
    default=None,
    show_default="the model's own sampled text",
    help="With --kv-cache int8: text to calibrate the scales on.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def convert(model: str, output: str, force: bool, quiet: bool, **settings: Any) -> None:
    """Convert a GGUF MoE model (first file of a split model) into an ONNX decoder, or fuse the MoE
    subgraphs of an ONNX model (MODEL.onnx or a model directory) into QMoE nodes."""
    from moepass.convert import convert as run_convert

    progress = _Progress("writing weights", enabled=not quiet)
    try:
        result = run_convert(model, output, overwrite=force, progress=progress, echo=click.echo, **settings)
    finally:
        progress.close()
    for line in result.summary_lines():
        click.echo(line)


@main.command()
@_model_argument("path", "PATH")
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect(path: str, as_json: bool) -> None:
    """Describe a GGUF file or a converted ONNX model: architecture, MoE layers, formats, bytes per group."""
    from moepass.inspection import format_inspection
    from moepass.inspection import inspect as run_inspect

    info = run_inspect(path)
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
    else:
        for line in format_inspection(info):
            click.echo(line)


_CACHE_DIR = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The GGUF cache folder (default: $MOEPASS_CACHE, else $XDG_CACHE_HOME/moepass, else ~/.cache/moepass).",
)


@main.group()
def cache() -> None:
    """The conversions of GGUF files given to run, chat, serve and bench: list them, remove stale ones."""


@cache.command("list")
@_CACHE_DIR
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def cache_list(cache_dir: str | None, as_json: bool) -> None:
    """Each entry: its size, the GGUF it was made from and whether it is current (still the file's
    conversion), stale (the file changed or is gone, an older moepass made it) or incomplete."""
    from moepass.gguf_cache import entries

    root, found = entries(cache_dir)
    if as_json:
        click.echo(json.dumps({"cache": str(root), "entries": [dataclasses.asdict(e) for e in found]}, indent=1))
        return
    total = sum(e.bytes for e in found)
    click.echo(f"{root}: {len(found)} entr{'y' if len(found) == 1 else 'ies'}, {format_bytes(total)}")
    for e in found:
        click.echo(f"  {e.name}  {format_bytes(e.bytes):>10}  {e.state:<22}  {e.source or '-'}")


@cache.command()
@_CACHE_DIR
def prune(cache_dir: str | None) -> None:
    """Remove the entries that are no longer any file's conversion (the file changed or is gone, an
    older moepass made it, a conversion was cut short), and what killed conversions left."""
    from moepass.gguf_cache import remove_entries

    removed, freed = remove_entries(cache_dir, lambda e: e.stale)
    click.echo(f"removed {len(removed)} stale entr{'y' if len(removed) == 1 else 'ies'}, {format_bytes(freed)} freed")


@cache.command()
@_CACHE_DIR
def clear(cache_dir: str | None) -> None:
    """Remove every entry of this user's (each is converted again when next used)."""
    from moepass.gguf_cache import remove_entries

    removed, freed = remove_entries(cache_dir, lambda e: True)
    click.echo(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, {format_bytes(freed)} freed")


_CACHE_DIR = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="For a GGUF MODEL: where its conversion is kept (default: $MOEPASS_CACHE, else "
    "$XDG_CACHE_HOME/moepass, else ~/.cache/moepass).",
)


def _runtime_options(f):
    """Options shared by run, chat, serve and bench: where and how the model is loaded."""
    for option in reversed(
        [
            click.option(
                "--device",
                type=click.Choice(DEVICES),
                default="auto",
                show_default=True,
                help="auto: the best EP available; cuda: fail unless a CUDA EP is there.",
            ),
            click.option(
                "--cuda-plugin",
                type=click.Path(dir_okay=False),
                default=None,
                help=f"ONNX Runtime CUDA plugin EP library (default: ${PLUGIN_ENV}).",
            ),
            _CACHE_DIR,
            click.option(
                "--offload",
                "mode",
                type=click.Choice(keys.OFFLOAD_MODES),
                default=None,
                help="Expert offload: disabled, auto (fall back with a warning) or required "
                "(default: what partition wrote).",
            ),
            _threads_option("ONNX Runtime's: every core", "ONNX Runtime intra-op threads."),
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


def _load_options(options: dict) -> dict:
    """The keyword arguments of moepass.runtime.load among the CLI's options (taken out of them)."""
    names = ("device", "cuda_plugin", "mode", "threads", "speculative", "draft_tokens")
    return {n: options.pop(n) for n in names}


def _echo_placement(decoder) -> None:
    """Where ONNX Runtime put the MoE layers of a per-layer plan (its graph assignment record)."""
    if decoder.moe_placement:
        counts = collections.Counter(decoder.moe_placement.values())
        click.echo("MoE layers: " + ", ".join(f"{n} on {ep}" for ep, n in sorted(counts.items())), err=True)


def _sampling_options(greedy: bool):
    """Sampling options shared by run, chat and serve, as llama.cpp names them; the defaults are
    greedy decoding (run) or llama-server's (chat, serve)."""
    d = Sampling() if greedy else LLAMA_SERVER

    def decorate(f):
        f = click.option(
            "-s",
            "--seed",
            type=click.IntRange(0, 2**64 - 1),
            default=None,
            show_default="random",
            help="Seed for sampled decoding.",
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


def _sampling(options: dict) -> Sampling:
    names = [_field(flag) for flag, _, _ in SAMPLING_OPTIONS] + ["seed"]
    return Sampling(**{n: options.pop(n) for n in names})


def _require(extra: str, what: str, *modules: str) -> None:
    """An extra's packages, checked before the model loads (not after a minute of loading)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MoepassError(f"{what} needs {', '.join(missing)}: pip install 'moepass[{extra}]'")


def _converted(model: str, options: dict) -> str:
    """MODEL itself, or for a GGUF file its conversion, made once into the cache (said in one line)."""
    from moepass.gguf_cache import resolve, resolve_draft

    cache_dir = options.pop("cache_dir")
    if not os.path.exists(model):  # said before "loading ...", as convert and inspect say it
        raise no_such_path(model)
    # a bar on a terminal; a log a line every LOG_EVERY seconds (a conversion takes minutes)
    progress = _Progress(f"converting {os.path.basename(model)}", enabled=True)

    def say(line: str) -> None:
        progress.close()  # a bar still drawn: its line ended first
        _stderr(line)

    try:
        folder = resolve(model, cache_dir, echo=say, progress=progress)
    finally:
        progress.close()
    if options.get("speculative"):
        options["speculative"] = resolve_draft(options["speculative"], cache_dir, echo=_stderr)
    return str(folder)


def _speed(prompt_n: int, prompt_s: float, generated: int, generation_s: float) -> list[str]:
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


def _stderr(line: str) -> None:
    click.echo(line, err=True)


def _load(model_dir: str, options: dict):
    """The model as run, chat and serve load it (a partitioned model with its placement; a GGUF
    through the cache)."""
    from moepass.runtime import load

    given, model_dir = model_dir, _converted(model_dir, options)
    context = _context_size(given, model_dir, options.pop("ctx_size"))
    start = time.perf_counter()
    click.echo(f"loading {model_dir} ...", err=True)
    decoder = load(model_dir, **_load_options(options))
    click.echo(f"loaded in {time.perf_counter() - start:.1f} s on {decoder.plan.provider}", err=True)
    _run_within(decoder, context)
    _echo_placement(decoder)
    if decoder.speculator is not None:
        click.echo(decoder.speculator.describe(), err=True)
    return decoder


def _context_size(given: str, model_dir: str, ctx_size: int) -> int | None:
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


def _run_within(decoder, context: int | None) -> None:
    """Run the loaded model within -c's context: the decoder's context length bounds each request
    (a prompt that fills it is refused, generation stops at it) and the KV cache, which grows to it
    and no further."""
    if context:
        decoder.context_length = context


def _max_new_tokens_option(default: int, least: int, text: str) -> Callable:
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


def _until_full(decoder) -> int:
    """-n -1: the tokens to ask for (the context's), each request then given as many as the context
    has room for after its prompt, without the warning that a request was cut (this one asked to be)."""
    context = decoder.context_length
    if not context:
        raise click.UsageError("-n -1 generates until the context is full; this model records no context: give -c N")
    decoder.until_full = True
    return context


def _think_option(f):
    return click.option(
        "--think/--no-think",
        default=None,
        help="Turn the template's reasoning switch on or off (Qwen3's enable_thinking).",
    )(f)


def _template_variables(decoder, think: bool | None) -> dict:
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


_STOP = click.option("--stop", multiple=True, help="Stop when the text reaches this string (repeatable); not shown.")


@main.command()
@_model_argument()
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
@_think_option
@_max_new_tokens_option(16, 0, "Tokens to generate at most")
@_STOP
@_sampling_options(greedy=True)
@_runtime_options
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
        _require("chat", "--chat", "jinja2")
    sampling = _sampling(options)
    decoder = _load(model_dir, options)
    until_full = max_new_tokens == -1
    if until_full:
        max_new_tokens = _until_full(decoder)
    start = time.perf_counter()
    if prompt is not None:
        text: str | list[int] = prompt
        if chat:
            variables = _template_variables(decoder, think)
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
        ids = _parse_ids(prompt_ids or "")
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
    for line in _speed(*timed):
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


@main.command()
@_model_argument()
@click.option("--system", default=None, help="A system message that opens the conversation.")
@_think_option
@_max_new_tokens_option(1024, 1, "Tokens per answer at most")
@_STOP
@_sampling_options(greedy=False)
@_runtime_options
def chat(
    model_dir: str, system: str | None, think: bool | None, max_new_tokens: int, stop: tuple[str, ...], **options
) -> None:
    """Talk to the model in the terminal, turn after turn (the KV cache keeps the history).

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from moepass.serve.chat import chat_loop

    _require("chat", "moepass chat", "jinja2")
    sampling = _sampling(options)
    decoder = _load(model_dir, options)
    if max_new_tokens == -1:
        max_new_tokens = _until_full(decoder)
    chat_loop(decoder, system, _template_variables(decoder, think), max_new_tokens, sampling, stop)


@main.command()
@_model_argument()
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
    help="Requests that may wait while one is answered; more get 503.",
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
@_runtime_options
def serve(
    model_dir: str,
    host: str,
    port: int,
    api_key: str | None,
    queue_size: int,
    max_body: str,
    body_seconds: float,
    **options,
) -> None:
    """An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health) with
    llama-server's own endpoints (/completion, /props, /slots, /metrics).

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from pathlib import Path

    from moepass.serve.server import check_api_key, listen
    from moepass.serve.server import serve as run_server

    _require("serve", "moepass serve", "fastapi", "uvicorn", "jinja2")
    check_api_key(api_key)  # before the port and the model
    body_limit = parse_bytes(max_body, "--max-body")
    listener = listen(host, port)  # before the model loads: a busy port says so at once
    decoder = _load(model_dir, options)
    given = Path(model_dir).resolve()  # a GGUF goes by its file's name, as in llama-server
    model_id = given.stem if given.suffix == ".gguf" else (given.parent if given.is_file() else given).name
    run_server(
        decoder, model_id, listener, api_key, queue_size, echo=_stderr, max_body=body_limit, body_seconds=body_seconds
    )


@main.command()
@_model_argument()
@click.option(
    "-p",
    "--prompt-tokens",
    type=click.IntRange(1, None),
    default=128,
    show_default=True,
    help="Tokens in the prefill measured (llama-bench's -p).",
)
@click.option(
    "-n",
    "--new-tokens",
    type=click.IntRange(1, None),
    default=64,
    show_default=True,
    help="Tokens decoded per measurement (llama-bench's -n).",
)
@click.option(
    "--depth",
    type=click.IntRange(1, None),
    default=None,
    help="Decode after this many cached tokens (default: after the prompt).",
)
@click.option(
    "-r",
    "--repeats",
    type=click.IntRange(1, None),
    default=3,
    show_default=True,
    help="Measurements of each phase; the best counts (llama-bench's -r).",
)
@click.option(
    "-f",
    "--prompt-file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="Measure on this text's tokens instead of -p pseudo-random ones (for --speculative, whose drafts "
    "depend on the text).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Also profile 16 decode steps: kernel time per operator type, and the executor's time between kernels.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout (llama-bench-like fields).")
@_runtime_options
def bench(model_dir: str, prompt_file, profile: bool, as_json: bool, **options) -> None:
    """Prefill and decode speed (tokens/s of the best of --repeats; min/median/max), peak RSS; with
    --speculative, decode with and without it and the share of drafts kept.

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from moepass.runtime import load
    from moepass.runtime.bench import decode_profile, measure
    from moepass.runtime.decoder import default_threads

    prompt_tokens, new_tokens, depth, repeats = (
        options.pop(k) for k in ("prompt_tokens", "new_tokens", "depth", "repeats")
    )
    if prompt_file is not None and depth is not None:
        raise click.UsageError("--depth applies to pseudo-random prompts; with --prompt-file decode follows the text")
    given, model_dir = model_dir, _converted(model_dir, options)
    context = _context_size(given, model_dir, options.pop("ctx_size"))
    load_options = _load_options(options)
    start = time.perf_counter()
    decoder = load(model_dir, **load_options)
    click.echo(f"loaded {model_dir} in {time.perf_counter() - start:.1f} s on {decoder.plan.provider}", err=True)
    _echo_placement(decoder)
    _run_within(decoder, context)
    prompt = None
    if prompt_file is not None:
        prompt = decoder.encode(prompt_file.read())
        if not prompt:
            raise MoepassError(f"{prompt_file.name}: the prompt file holds no text")
        prompt_tokens = len(prompt)
    _check_bench_fits(decoder, prompt_tokens, depth, new_tokens)
    result = measure(
        decoder,
        prompt_tokens,
        new_tokens,
        repeats,
        depth,
        progress=None if as_json else _stderr,
        prompt=prompt,
    )
    result.update(
        model=str(model_dir),
        backend=decoder.plan.provider,
        threads=decoder.threads or default_threads(),
        activations=decoder.report.activations,
        size_bytes=sum(f.stat().st_size for f in decoder.model_dir.iterdir() if f.is_file())
        if decoder.model_dir.is_dir()
        else 0,
        n_params=sum(
            round(w["bytes"] * 8 / w["bits_per_weight"]) for w in decoder.report.weights if w.get("bits_per_weight")
        ),
    )
    used = str(decoder.threads) if decoder.threads else f"{default_threads()} (ONNX Runtime's default)"
    provider = decoder.plan.provider
    if profile:
        del load_options["speculative"], load_options["draft_tokens"]
        del decoder  # the profiling session loads the model again: not two copies of its weights at once
        gc.collect()
        where = decode_profile(model_dir, depth=depth or prompt_tokens, **load_options)
        result["decode_profile"] = where
        result["decode_operator_shares"] = where["operator_shares"]
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
        return
    for phase, what in (
        ("prefill", f"{prompt_tokens} tokens"),
        ("decode", f"{new_tokens} tokens after {result['decode']['depth']}"),
    ):
        r = result[phase]
        click.echo(
            f"{phase:<8} {r['tokens_per_s']:10.1f} tokens/s  ({what}; seconds min/median/max "
            f"{r['seconds_min']:.3f}/{r['seconds_median']:.3f}/{r['seconds_max']:.3f})"
        )
    if "speculative" in result:
        spec = result["speculative"]
        click.echo(
            f"plain    {spec['plain_decode']['tokens_per_s']:10.1f} tokens/s  (decode without "
            f"speculation: {spec['speedup']:.2f}x with it; {spec['acceptance']:.0%} of drafts kept, "
            f"{spec['tokens_per_step']:.2f} tokens per step)"
        )
    click.echo(
        f"peak RSS {result['peak_rss_bytes'] / 2**20:10.0f} MiB      ({provider}, "
        f"{used} threads, {result['activations']} activations)"
    )
    if "decode_profile" in result:
        where = result["decode_profile"]
        click.echo(
            f"profile  {where['step_ms']:10.2f} ms a decode step under the profiler: kernels "
            f"{where['nodes_ms']:.2f} ms, the executor between them {where['framework_ms']:.2f} ms"
        )
        for op, v in where["operators"].items():
            if v["ms"] >= 0.01 * where["nodes_ms"]:
                click.echo(
                    f"  {op:<36}{v['ms'] / where['nodes_ms']:7.1%} of decode kernel time ({v['nodes']:.0f} nodes)"
                )


def _check_bench_fits(decoder, prompt_tokens: int, depth: int | None, new_tokens: int) -> None:
    """bench's measurements within the context (-c, else the model's): each generation takes its
    prompt (-p or --depth) and -n tokens, and one more chosen after the last step."""
    context, built = decoder.context_length, decoder.report.context_length
    cached = max(prompt_tokens, depth or 0)
    needed = cached + new_tokens + 1
    if context and needed > context:
        more = f"a larger -c (up to {built})" if built and context < built else f"convert --context {needed}"
        raise MoepassError(
            f"bench needs a context of {needed} tokens ({cached} cached, -n {new_tokens} and the token after "
            f"them); the context holds {context}: fewer tokens, or {more}"
        )


@main.command()
@_model_argument()
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Calibration prompts file (see --prompts-format).",
)
@click.option(
    "--prompts-format",
    type=click.Choice(PROMPT_FORMATS),
    default="text",
    show_default=True,
    help="text: one prompt per line; ids: token ids per line (commas or spaces, '#' comments); "
    'jsonl: a JSON string, id list, or {"text"|"ids": ...} per line.',
)
@click.option("--chat", is_flag=True, help="Wrap each text prompt in the model's chat template, as run --chat does.")
@click.option("--prompt-ids", default=None, help="One calibration prompt as comma-separated token ids.")
@click.option("-o", "--output", required=True, type=click.Path(), help="Popularity file to write (JSON).")
@click.option(
    "--merge",
    "merge_with",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Add these earlier profiles of the same model to the result (repeatable).",
)
@_threads_option("ONNX Runtime's: every core", "ONNX Runtime intra-op threads.")
@_CACHE_DIR
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def profile(
    model_dir: str, output: str, merge_with: tuple[str, ...], threads: int | None, force: bool, quiet: bool, **flags
) -> None:
    """Measure expert popularity: run calibration prompts through a model on the CPU.

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from moepass.pipeline.atomic import check_destination
    from moepass.pipeline.popularity import Popularity
    from moepass.profile import profile as run_profile
    from moepass.profile import read_prompts

    prompts_file, prompts_format, prompt_ids, chat = (
        flags.pop(k) for k in ("prompts_file", "prompts_format", "prompt_ids", "chat")
    )
    if (prompts_file is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompts FILE or --prompt-ids 1,2,3")
    check_destination(output, force, is_dir=False)  # before the work, not after it
    if chat:
        _require("chat", "--chat", "jinja2")
    prompts = read_prompts(prompts_file, prompts_format) if prompts_file else [_parse_ids(prompt_ids or "")]
    model_dir = _converted(model_dir, flags)
    earlier = [Popularity.load(p) for p in merge_with]
    progress = _Progress("profiling prompts", enabled=not quiet, unit="prompts")
    try:
        result = run_profile(model_dir, prompts, threads=threads, progress=progress, chat=chat)
    finally:
        progress.close()
    for path, other in zip(merge_with, earlier):
        result = result.merge(other, path)
    result.save(output, overwrite=force)
    click.echo(
        f"profiled {result.tokens} tokens ({result.prompts} prompts) over {len(result.selected)} MoE layers -> {output}"
    )
    click.echo(f"  {result.coverage_line()}")


@main.command("merge-profiles")
@click.argument("profiles", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(), help="Merged popularity file to write.")
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
def merge_profiles(profiles: tuple[str, ...], output: str, force: bool) -> None:
    """Add up popularity profiles of the same model."""
    from moepass.pipeline.atomic import check_destination
    from moepass.pipeline.popularity import Popularity

    check_destination(output, force, is_dir=False)  # before reading the profiles
    merged = Popularity.load(profiles[0])
    for path in profiles[1:]:
        merged = merged.merge(Popularity.load(path), path)
    merged.save(output, overwrite=force)
    click.echo(f"merged {len(profiles)} profiles: {merged.tokens} tokens -> {output}")


@main.command()
@_model_argument()
@click.option(
    "--vram",
    default=None,
    show_default="the --gpu card's memory",
    help=f"GPU memory to use: {BYTES_RULE}.",
)
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(),
    help="Directory for the placed model and plan (default: MODEL-placed beside the model).",
)
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="auto",
    show_default=True,
    help="offload: per expert, for the ONNX Runtime CUDA plugin EP's expert offload; layers: whole MoE "
    "layers on the GPU or the CPU, through layer annotations the CUDA EP of a pip-installed "
    "onnxruntime-gpu follows (like llama.cpp's --n-cpu-moe); auto: offload when the model is "
    "eligible and a CUDA plugin EP is named, else layers.",
)
@click.option(
    "--cuda-plugin",
    type=click.Path(dir_okay=False),
    default=None,
    help=f"The CUDA plugin EP library the model will run with (default: ${PLUGIN_ENV}); for --target auto.",
)
@click.option(
    "--profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Popularity file from `moepass profile` (without one, placement is uniform).",
)
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default=None,
    help="global (default with a profile), balanced, or uniform (default without).",
)
@click.option(
    "--mode",
    type=click.Choice(PLAN_MODES),
    default="auto",
    show_default=True,
    help="required: fail when the non-expert weights, KV cache and buffers do not fit.",
)
@click.option(
    "-c",
    "--context",
    type=click.IntRange(1, None),
    default=None,
    help="Tokens the KV cache holds (default: the model's context, at most 4096; the summary says which).",
)
@click.option("--batch", type=click.IntRange(1, None), default=1, show_default=True, help="Sequences at once.")
@click.option(
    "--prefill-tokens",
    type=click.IntRange(1, None),
    default=512,
    show_default=True,
    help="Tokens per prefill step (sizes the working buffers).",
)
@click.option("--reserve", default="512MiB", show_default=True, help="GPU memory kept for the runtime itself.")
@_bandwidth_option(
    "--gpu-bandwidth", f"the --gpu card's, else {Bandwidths.gpu:g}", "GPU memory GB/s, for the estimate."
)
@_bandwidth_option(
    "--host-bandwidth", Bandwidths.host, "Host memory GB/s, where the CPU side is not timed (--no-calibrate)."
)
@_bandwidth_option(
    "--pcie-bandwidth", f"the --gpu card's link, else {Bandwidths.pcie:g}", "Host-GPU link GB/s, for the estimate."
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also draw the plan (heatmap and memory bar) into this PNG file.",
)
@click.option("--force", is_flag=True, help="Replace the output directory (and report) if moepass wrote them.")
@click.option(
    "--gpu",
    "gpu_preset",
    type=click.Choice(sorted(GPU_PRESETS)),
    default=None,
    help="A card's memory, bandwidth and PCIe link from its data sheet (moepass/core/choices.py); "
    "--vram and the bandwidth options override it.",
)
@click.option(
    "--cpu-profile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Take the CPU side of the estimate from an earlier plan.json instead of timing it now.",
)
@click.option("--no-calibrate", is_flag=True, help="No timing on this CPU: the bandwidth model alone.")
@_threads_option("ONNX Runtime's: every core", "Threads the CPU timing uses (those run and bench will use).")
@click.option(
    "--ignore-kernel-table",
    is_flag=True,
    help="Plan as if the CUDA EP took every node (for an ONNX Runtime build newer than moepass's table of "
    "its kernels); by default MoE layers it has no kernel for stay on the CPU.",
)
@click.option(
    "--kv-cache",
    type=click.Choice(["keep", "auto", *KV_CACHE_TYPES]),
    default="keep",
    show_default=True,
    help="The KV cache's type in the placed model: the model's, another (from float32), or auto: float16 "
    "where its smaller cache buys resident experts (plan.json says what each type would buy).",
)
@click.option(
    "--keep-form",
    is_flag=True,
    help="Annotate (or reorder) the model as it is instead of writing its GPU form: its float32 nodes, which "
    "no CUDA kernel takes, then stay on the CPU whatever the plan.",
)
@click.option(
    "--gguf",
    type=click.Path(dir_okay=False),
    default=None,
    help="The GGUF the model was converted from, where it is now (its GPU form is packed from the file's "
    "blocks); default: where its moepass.json records it.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress.")
def partition(model_dir: str, vram: str | None, output: str | None, force: bool, quiet: bool, **flags: Any) -> None:
    """Choose which experts (or whole MoE layers) live on the GPU for a VRAM budget; write the model in
    the form the GPU's EP takes (float16, each GPU node in a form its kernels take), the plan and the
    ONNX Runtime options. MODEL: a converted model, or a GGUF file (converted here in one step)."""
    from moepass.partition import partition as run_partition

    card = GPU_PRESETS.get(flags["gpu_preset"]) if flags["gpu_preset"] else None
    vram = vram or (card.vram if card else "")
    if not vram:
        raise click.UsageError("give --vram SIZE or --gpu NAME")
    progress = _Progress("writing the placed model", enabled=not quiet)
    try:
        result = run_partition(
            model_dir,
            output,
            vram,
            overwrite=force,
            warn=lambda m: click.echo(f"moepass: warning: {m}", err=True),
            progress=progress,
            **_partition_settings(flags, card),
        )
    finally:
        progress.close()
    for line in result.summary_lines():
        click.echo(line)


def _partition_settings(flags: dict[str, Any], card: Any) -> dict[str, Any]:
    """partition's flags as moepass.partition.PartitionOptions' fields: the negated flags turned
    round, the bandwidths from the flags over the --gpu card's data sheet over the defaults."""
    flags = dict(flags)
    gpu_preset = flags.pop("gpu_preset")
    given = {name: flags.pop(f"{name}_bandwidth") for name in ("gpu", "host", "pcie")}
    sheet = {"gpu": card.bandwidth, "host": None, "pcie": card.pcie} if card else {}
    figures = [f"--gpu {gpu_preset}'s data sheet"] if card else []
    figures += [f"--{name}-bandwidth" for name, value in given.items() if value is not None]
    chosen: dict[str, Any] = {}
    for name, value in given.items():
        preset = sheet.get(name)
        chosen[name] = value if value is not None else preset if preset is not None else getattr(Bandwidths, name)
    if figures and (card or given["gpu"]):
        chosen["source"] = "from " + ", ".join(figures)
    turned = {
        "kernel_table": not flags.pop("ignore_kernel_table"),
        "calibrate": not flags.pop("no_calibrate"),
        "lower": not flags.pop("keep_form"),
    }
    return {**flags, **turned, "bandwidths": Bandwidths(**chosen)}


if __name__ == "__main__":
    main()
