"""Fuzzing `inspect` and `convert` with damaged GGUF headers, metadata and tensor tables.

Hypothesis mutates the fixture's header region (every byte before the tensor data): random byte
flips, boundary values written over the fields the gguf reader parses (counts, lengths, value
types, dimensions, tensor types and offsets), and truncation. Each damaged file must end in exit 0
or exit 2 with one `moepass: error:` line: never a traceback, never a hang, never a leftover; and a
file that converts must give a model whose logits are finite.

Seeded (the same examples on every run) and bounded to about a minute in CI. A longer run:
`MOEPASS_FUZZ_EXAMPLES=5000 python -m pytest -q tests/test_fuzz.py` (docs/benchmarks.md records one).
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from moepass.cli import main

EXAMPLES = int(os.environ.get("MOEPASS_FUZZ_EXAMPLES", "2400"))
BATCH = 300
SECONDS_PER_EXAMPLE = 60
BOUNDARY_VALUES = [0, 1, 2, 3, 7, 8, 31, 32, 255, 256, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 1 << 32, 1 << 40,
                   (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


class _Hang(Exception):
    pass


def _field_offsets(path: Path) -> tuple[bytes, int, list[int]]:
    """The file's bytes, where its tensor data starts, and the offset of every parsed header field."""
    reader = GGUFReader(str(path))
    base = reader.data.__array_interface__["data"][0]
    offsets = set()
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            offsets.add(int(part.__array_interface__["data"][0] - base))
    data_start = int(reader.data_offset)
    del reader
    return path.read_bytes(), data_start, sorted(o for o in offsets if o < data_start)


@pytest.fixture(scope="module")
def pristine(make_gguf):
    return _field_offsets(make_gguf("q4_0"))


def _mutations(pristine):
    data, data_start, fields = pristine
    flips = st.lists(st.tuples(st.integers(0, data_start - 1), st.integers(0, 255)), min_size=1, max_size=6)
    words = st.lists(st.tuples(st.sampled_from(fields), st.sampled_from(BOUNDARY_VALUES), st.sampled_from([1, 2, 4, 8])),
                     min_size=1, max_size=3)
    cut = st.integers(0, len(data) - 1)
    return st.one_of(flips.map(lambda f: ("flip", f)), words.map(lambda w: ("word", w)), cut.map(lambda c: ("cut", c)))


def _apply(data: bytes, mutation) -> bytes:
    kind, what = mutation
    if kind == "cut":
        return data[:what]
    out = bytearray(data)
    if kind == "flip":
        for at, value in what:
            out[at] = value
    else:
        for at, value, width in what:
            out[at:at + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return bytes(out[:len(data)])


def _check_cli(args: list[str]) -> int:
    result = CliRunner().invoke(main, args)
    assert "Traceback" not in result.stderr and "this is a bug" not in result.stderr, (args, result.stderr)
    assert result.exit_code in (0, 2), (args, result.exit_code, result.output, result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("moepass: error:")]
    assert len(errors) == (1 if result.exit_code == 2 else 0), result.stderr
    return result.exit_code


def _logits_are_finite(model_dir: Path) -> None:
    from moepass.runtime import load

    decoder = load(model_dir, threads=1)
    n = min(4, decoder.context_length or 4)
    logits, _ = decoder.forward(np.arange(1, n + 1)[None] % decoder.vocab_size, decoder.empty_cache())
    assert np.isfinite(logits).all(), f"{model_dir}: non-finite logits"


def _on_alarm(signum, frame):
    raise _Hang(f"one example ran past {SECONDS_PER_EXAMPLE} s")


def test_fuzz_gguf_header(pristine):
    """In batches of BATCH examples, each with its own fixed seed: hypothesis keeps a record of every
    example of a run, which grows without bound over a long run."""
    for batch in range(math.ceil(EXAMPLES / BATCH)):
        _fuzz_batch(pristine, batch, min(BATCH, EXAMPLES - batch * BATCH))


def _fuzz_batch(pristine, batch: int, examples: int) -> None:
    data = pristine[0]

    @seed(batch)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_mutations(pristine))
    def one(mutation):
        damaged = _apply(data, mutation)
        with tempfile.TemporaryDirectory() as folder:
            folder = Path(folder)
            path = folder / "fuzz.gguf"
            path.write_bytes(damaged)
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.alarm(SECONDS_PER_EXAMPLE)
            try:
                _check_cli(["inspect", str(path)])
                out = folder / "out"
                if _check_cli(["convert", str(path), "-o", str(out), "-q"]) == 0:
                    _logits_are_finite(out)
                else:
                    assert not out.exists()
                assert sorted(p.name for p in folder.iterdir() if p.name != "fuzz.gguf") in ([], ["out"])
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

    one()
