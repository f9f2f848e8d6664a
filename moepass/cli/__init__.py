"""The moepass command line: convert, inspect, profile, merge-profiles, partition, run, chat, serve,
bench, cache; one module per command (moepass.cli.convert, ...), what they share in moepass.cli.common.

Bad input ends with one line `moepass: error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback

import click

from moepass.core.errors import CLI_WORDING, expected_failure, worded_as

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


# the commands, each from its own module
from moepass.cli.bench import bench  # noqa: E402
from moepass.cli.cache import cache  # noqa: E402
from moepass.cli.chat import chat  # noqa: E402
from moepass.cli.convert import convert  # noqa: E402
from moepass.cli.inspect import inspect  # noqa: E402
from moepass.cli.partition import partition  # noqa: E402
from moepass.cli.profile import merge_profiles, profile  # noqa: E402
from moepass.cli.run import run  # noqa: E402
from moepass.cli.serve import serve  # noqa: E402

for _command in (convert, inspect, cache, run, chat, serve, bench, profile, merge_profiles, partition):
    main.add_command(_command)
