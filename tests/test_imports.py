"""Every module imports on its own, first, in a fresh interpreter: no import cycle survives by
statement order (an import sorter must not be able to break `import moepass`)."""

from __future__ import annotations

import pkgutil
import random
import subprocess
import sys

import moepass
import moepass.passes
import moepass.runtime


def _modules() -> list[str]:
    names = ["moepass"]
    for package in (moepass, moepass.passes, moepass.runtime):
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return sorted(set(names))


def test_every_module_imports_alone_in_any_order():
    names = _modules()
    assert {"moepass.cli", "moepass.passes.lower", "moepass.runtime.providers"} <= set(names)
    random.Random(0).shuffle(names)
    failed = {}
    for start in range(0, len(names), 4):  # four interpreters at a time
        running = [(name, subprocess.Popen([sys.executable, "-c", f"import {name}"], stderr=subprocess.PIPE,
                                           text=True)) for name in names[start:start + 4]]
        for name, process in running:
            _, stderr = process.communicate(timeout=300)
            if process.returncode:
                failed[name] = stderr.strip().splitlines()[-1]
    assert not failed, failed


def test_no_module_imports_through_the_package_root():
    """`from moepass import X` inside the package ties a module to moepass/__init__.py's statement order
    (the cycle moepass -> convert -> passes -> lower -> moepass once hung on it)."""
    import ast
    from pathlib import Path

    offenders = []
    for package in (moepass, moepass.passes, moepass.runtime):
        for path in Path(package.__path__[0]).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "moepass" and node.level == 0:
                    offenders.append(f"{path.name}: from moepass import {', '.join(a.name for a in node.names)}")
    assert not offenders, offenders
