"""Shared fixtures: generated GGUF models (fixed seeds) and their conversions, made once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Test the moepass that is installed, editable or not: `python -m pytest` puts the working directory
# (the repository root) first on sys.path, where the source folder moepass/ lacks passes/, runtime/ and
# cuda_ops/ (setuptools maps them in as subpackages only when installing) and would shadow an installed
# copy. An editable install finds the source tree through its own meta-path finder, not through sys.path.
# Subprocesses started by the tests run with another working directory (cwd=) for the same reason.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT / "tests"))

import make_fixtures  # noqa: E402


def _cached_by_arguments(root: Path, build):
    """f(preset, **kwargs) that calls build(fresh folder, preset, **kwargs) once per distinct arguments."""
    cache: dict[tuple, Path] = {}

    def get(preset: str = "q4_0", **kwargs) -> Path:
        key = (preset, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in cache:
            folder = root / f"{len(cache)}"
            folder.mkdir()
            cache[key] = build(folder, preset, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def make_gguf(tmp_path_factory):
    """make_gguf(preset, **kwargs) -> path of a generated qwen3moe GGUF (cached per arguments)."""
    return _cached_by_arguments(
        tmp_path_factory.mktemp("gguf"),
        lambda folder, preset, **kw: make_fixtures.write_moe_gguf(folder / f"{preset}.gguf", preset, **kw))


@pytest.fixture(scope="session")
def converted(tmp_path_factory, make_gguf):
    """converted(preset, activations="int8", expert_format="qmoe", exact=False, **gguf_kwargs) ->
    directory of the converted model (cached); tests of exact arithmetic ask for activations="float",
    tests of exact repacks for exact=True. ONNX Runtime's own forms (qmoe) unless a test asks for
    another: the suite's many tests of those forms and of what partition and the runtime do with
    them; moepass's own kernels (convert's default on the CPU, "auto") are tests/test_cpu_ops.py's,
    and the CLI's and the API's defaults run them everywhere else."""
    from moepass.convert import convert

    def build(folder, preset, activations="int8", expert_format="qmoe", exact=False, **kw):
        return convert(make_gguf(preset, **kw), folder / "model", activations=activations,
                       expert_format=expert_format, exact=exact).output_dir

    return _cached_by_arguments(tmp_path_factory.mktemp("onnx"), build)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(family, bits=None, block_size=32, **export_kwargs) -> path of a Hugging Face MoE model
    exported by torch.onnx.export (and quantized by ONNX Runtime's MatMulNBits quantizer when `bits`)."""
    import make_onnx_fixtures

    def build(folder: Path, family: str, bits=None, block_size=32, symmetric=False, exclude=(), accuracy_level=None,
              **kwargs) -> Path:
        path = make_onnx_fixtures.export_hf_moe(folder / f"{family}.onnx", family, **kwargs)
        if bits:
            path = make_onnx_fixtures.quantize_matmul_nbits(path, folder / f"{family}-q{bits}.onnx", bits=bits,
                                                            block_size=block_size, symmetric=symmetric,
                                                            exclude=exclude, accuracy_level=accuracy_level)
        return path

    return _cached_by_arguments(tmp_path_factory.mktemp("exported"), build)


@pytest.fixture(scope="session")
def trained_gguf(tmp_path_factory):
    """(path of the trained qwen3moe F32 GGUF, its importance matrix) — fixtures/train_fixture.py,
    trained anew in every session (a minute), so every run checks that it is the same file."""
    import train_fixture

    return train_fixture.train(tmp_path_factory.mktemp("trained") / "trained-f32.gguf", echo=lambda line: None)


@pytest.fixture(scope="session")
def trained_models(trained_gguf):
    """name -> (F32 GGUF, importance matrix, held-out token windows) of both trained models:
    "markov" (above; windows sampled from its language) and "text" (fixtures/hf_fixture.py: about
    three minutes of training, kept in the temporary directory between sessions under a digest of
    the fixture's source and the Python version, so CI's later passes reuse it)."""
    import hashlib
    import tempfile

    import hf_fixture
    import train_fixture

    key = hashlib.sha256(Path(hf_fixture.__file__).read_bytes() + sys.version.encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"moepass-test-text-fixture-{key}"
    return {"markov": (*trained_gguf, train_fixture.heldout_windows()),
            "text": hf_fixture.build(cache, "qwen3moe", echo=lambda line: None)}


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the tests in the reverse of their collected order (.ci/run: a result that "
                          "depends on what ran before it fails there)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
