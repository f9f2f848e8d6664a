"""Every module imports on its own, first, in a fresh interpreter: no import cycle survives by
statement order (an import sorter must not be able to break `import moepass`)."""

from __future__ import annotations

import pkgutil
import random
import subprocess
import sys

import moepass
import moepass.cli
import moepass.core
import moepass.cpu_ops
import moepass.cuda_ops
import moepass.passes
import moepass.passes.lower
import moepass.passes.weights
import moepass.pipeline
import moepass.runtime
import moepass.serve

PACKAGES = (moepass, moepass.core, moepass.cpu_ops, moepass.cuda_ops, moepass.passes, moepass.passes.lower, moepass.passes.weights,
            moepass.runtime,
            moepass.pipeline, moepass.serve, moepass.cli)


def _modules() -> list[str]:
    names = ["moepass"]
    for package in PACKAGES:
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    # the kernel library is a shared library ONNX Runtime loads, not a Python module
    return sorted(set(names) - {"moepass.cpu_ops._kernels"})


def test_every_module_imports_alone_in_any_order(tmp_path):
    names = _modules()
    assert {"moepass.cli", "moepass.passes.lower", "moepass.runtime.providers"} <= set(names)
    random.Random(0).shuffle(names)
    failed = {}
    for start in range(0, len(names), 4):  # four interpreters at a time
        # cwd: `-c` puts the working directory first on sys.path; the repository root's moepass/ would
        # shadow a non-editable install (tests/conftest.py)
        running = [(name, subprocess.Popen([sys.executable, "-c", f"import {name}"], stderr=subprocess.PIPE,
                                           text=True, cwd=tmp_path)) for name in names[start:start + 4]]
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
    for package in PACKAGES:
        for path in Path(package.__path__[0]).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "moepass" and node.level == 0:
                    offenders.append(f"{path.name}: from moepass import {', '.join(a.name for a in node.names)}")
    assert not offenders, offenders


# ---- the house: which layer may import which --------------------------------------------------------
# core: the facts (GGUF reading, quant and architecture tables, MoE node layout, names, errors);
# cuda_ops: kernel layouts; cpu_ops: moepass's own CPU kernels (a C library ONNX Runtime loads); passes: graph rewrites; runtime: ONNX Runtime sessions; pipeline: the
# stages commands are made of (the GGUF conversion, the KV cache's type, the files beside a model, the
# placement); commands: convert, partition, profile, inspect and the GGUF cache, none importing
# another; serve: the server and the chat; front: the CLI, the API (moepass/__init__.py) and the
# generator of docs' tables, which may use everything.
ALLOWED = {
    "core": {"core"},
    "cuda_ops": {"cuda_ops", "core"},
    "cpu_ops": {"cpu_ops", "core"},
    "passes": {"passes", "core", "cuda_ops"},
    "runtime": {"runtime", "core", "cpu_ops"},
    "pipeline": {"pipeline", "core", "cuda_ops", "passes", "runtime"},
    "commands": {"core", "cuda_ops", "passes", "runtime", "pipeline"},
    "serve": {"serve", "core", "runtime", "pipeline"},
    "front": {"front", "core", "cuda_ops", "passes", "runtime", "pipeline", "commands", "serve"},
}
FRONT = {"moepass", "moepass.cli", "moepass.support_tables"}


def _folder(module: str) -> str:
    if module in FRONT or module.startswith("moepass.cli."):
        return "front"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "commands"


def _import_graph() -> dict[str, set[str]]:
    """module -> the moepass modules it imports (anywhere in the file, lazy imports included)."""
    import ast
    from pathlib import Path

    modules = {}
    for package in PACKAGES:
        for path in Path(package.__path__[0]).glob("*.py"):
            name = package.__name__ if path.stem == "__init__" else f"{package.__name__}.{path.stem}"
            modules[name] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{name}: relative import")
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names] \
                if isinstance(node, ast.ImportFrom) else []
            targets |= {t for t in found if t in modules and t != name}
        graph[name] = targets
    return graph


def test_imports_run_down_the_house():
    """No layer imports one above it (runtime never imports passes, passes never a stage, a stage never
    a command, the core nothing but itself), and no command imports another."""
    graph = _import_graph()
    assert {"moepass.core.keys", "moepass.passes.lower", "moepass.runtime.providers", "moepass.cli",
            "moepass.pipeline.conversion", "moepass.serve.server"} <= set(graph)
    assert {_folder(m) for m in ("moepass.partition", "moepass.pipeline", "moepass.pipeline.atomic", "moepass.cli",
                                 "moepass.serve.chat", "moepass.passes.lower")} == \
        {"commands", "pipeline", "front", "serve", "passes"}
    wrong = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                   if _folder(b) not in ALLOWED[_folder(a)])
    assert not wrong, wrong


def test_no_module_cycle():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                raise AssertionError(" -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_help_imports_only_the_cli(tmp_path):
    """`moepass --help` loads click, the CLI, the option tables and the terminal's escaping (a few
    lines): none of the compiler, numpy or ONNX."""
    script = ("import sys; from moepass.cli import main\n"
              "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
              "print(' '.join(sorted(m for m in sys.modules if m.startswith(('moepass', 'numpy', 'onnx')))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert "Usage: " in out
    modules = set(out.splitlines()[-1].split())
    commands = {m for m in modules if m.startswith("moepass.cli.")}  # one module per command, and common
    assert {"moepass.cli.convert", "moepass.cli.partition", "moepass.cli.common"} <= commands
    assert modules - commands == {"moepass", "moepass.cli", "moepass.core", "moepass.core.choices",
                                  "moepass.core.errors", "moepass.core.gpus", "moepass.core.keys",
                                  "moepass.core.options", "moepass.core.sampling", "moepass.core.terminal",
                                  "moepass.core.version"}, modules
