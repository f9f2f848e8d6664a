"""What moepass writes to a terminal: generated text made safe to show."""

from __future__ import annotations

import sys

# C0 and C1 control characters but tab, newline and carriage return: what a random or broken model's
# text must not send to a terminal (escape sequences reprogram it)
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09, 0x0A, 0x0D)}


def terminal_safe(text: str) -> str:
    """Generated text for a terminal: control characters written as \\xNN escapes (a stdout that is
    not a terminal gets the text as it is)."""
    return text.translate(_CONTROL)


def for_stdout(text: str) -> str:
    """`text` as written to standard output: terminal_safe where that is a terminal, as it is elsewhere."""
    return terminal_safe(text) if sys.stdout.isatty() else text
