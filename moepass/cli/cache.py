"""`moepass cache`: the conversions of GGUF files given to run, chat, serve and bench."""

from __future__ import annotations

import dataclasses
import json

import click

from moepass.core.choices import (
    format_bytes,
)

_CACHE_FOLDER = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The GGUF cache folder (default: $MOEPASS_CACHE, else $XDG_CACHE_HOME/moepass, else ~/.cache/moepass).",
)


@click.group()
def cache() -> None:
    """The conversions of GGUF files given to run, chat, serve and bench: list them, remove stale ones."""


@cache.command("list")
@_CACHE_FOLDER
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
    # another user's folder may not be readable: its size unknown, not 0 B
    rows = [
        (e.name, "?" if e.foreign and not e.bytes else format_bytes(e.bytes), e.state, e.source or "-") for e in found
    ]
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(3)]
    for name, size, state, source in rows:
        click.echo(f"  {name:<{widths[0]}}  {size:>{widths[1]}}  {state:<{widths[2]}}  {source}")


@cache.command()
@_CACHE_FOLDER
def prune(cache_dir: str | None) -> None:
    """Remove the entries that are no longer any file's conversion (the file changed or is gone, an
    older moepass made it, a conversion was cut short), and what killed conversions left."""
    from moepass.gguf_cache import remove_entries

    removed, freed = remove_entries(cache_dir, lambda e: e.stale)
    click.echo(f"removed {len(removed)} stale entr{'y' if len(removed) == 1 else 'ies'}, {format_bytes(freed)} freed")


@cache.command()
@_CACHE_FOLDER
def clear(cache_dir: str | None) -> None:
    """Remove every entry of this user's (each is converted again when next used)."""
    from moepass.gguf_cache import remove_entries

    removed, freed = remove_entries(cache_dir, lambda e: True)
    click.echo(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, {format_bytes(freed)} freed")
