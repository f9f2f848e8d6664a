"""Shared fixtures: generated GGUF models (fixed seeds) and their conversions, made once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "tests"))

import make_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def make_gguf(tmp_path_factory):
    """make_gguf(preset, **kwargs) -> path of a generated qwen3moe GGUF (cached per arguments)."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("gguf")

    def make(preset: str = "q4_0", **kwargs) -> Path:
        key = (preset, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in cache:
            folder = root / f"m{len(cache)}"
            folder.mkdir()
            cache[key] = make_fixtures.write_qwen3moe_gguf(folder / f"{preset}.gguf", preset, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def converted(tmp_path_factory, make_gguf):
    """converted(preset, **gguf_kwargs) -> directory of the converted model (cached)."""
    from moepass.convert import convert

    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("onnx")

    def run(preset: str = "q4_0", **kwargs) -> Path:
        key = (preset, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in cache:
            out = root / f"c{len(cache)}"
            convert(make_gguf(preset, **kwargs), out)
            cache[key] = out
        return cache[key]

    return run
