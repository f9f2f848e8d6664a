"""llama.cpp's published chat templates (models/templates), where the tests find them: in the source
of the installed llama-cpp-python, which the test setup builds from source (fixtures/hf_fixture.py)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import hf_fixture


def _templates_dir() -> Path | None:
    """llama.cpp's models/templates from the installed llama-cpp-python's source (None without it)."""
    try:
        metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None
    return hf_fixture.converter() / "models" / "templates"


TEMPLATES_DIR = _templates_dir()
NO_TEMPLATES = "llama.cpp's models/templates come with llama-cpp-python's source, which is not installed"
