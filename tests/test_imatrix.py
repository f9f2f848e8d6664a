"""Importance matrices: both llama.cpp file formats read alike; requantization weighted by them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import moepass
from support.stored import stored_matrices
from make_fixtures import write_imatrix_dat as write_dat, write_imatrix_gguf as write_gguf
from moepass.core.imatrix import load_imatrix

EXPERT_TENSORS = [f"blk.{i}.ffn_{k}_exps.weight" for i in range(2) for k in ("gate", "up", "down")]


def _importance(make_gguf):
    rng = np.random.default_rng(5)
    reader = GGUFReader(make_gguf("q4_k"))
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return {name: rng.lognormal(0.0, 2.0, size=(shapes[name][0], shapes[name][-1])).astype(np.float32)
            for name in EXPERT_TENSORS}


def test_both_formats_read_alike(tmp_path, make_gguf):
    matrices = _importance(make_gguf)
    write_dat(tmp_path / "m.dat", matrices)
    write_gguf(tmp_path / "m.gguf", matrices)
    dat, gguf = load_imatrix(tmp_path / "m.dat"), load_imatrix(tmp_path / "m.gguf")
    for name, values in matrices.items():
        np.testing.assert_allclose(dat[name].reshape(values.shape), values, rtol=1e-6)
        np.testing.assert_allclose(gguf[name], values, rtol=1e-6)


def _weighted_errors(out, source, matrices):
    """Importance-weighted squared error of every stored expert matrix against the GGUF values
    (gate and up as block-sum features keep them, tests/support/stored.py)."""
    reader = GGUFReader(source)
    values = {t.name: gguf_dequantize(np.asarray(t.data), t.tensor_type) for t in reader.tensors}
    total = 0.0
    for ours, name in stored_matrices(out):
        if "_exps." in name:
            total += float(np.sum(matrices[name][:, None, :] * np.square(ours - values[name])))
    return total


def test_importance_lowers_the_weighted_error(tmp_path, make_gguf):
    matrices = _importance(make_gguf)
    write_dat(tmp_path / "m.dat", matrices)
    source = make_gguf("q4_k")
    plain = moepass.convert(source, tmp_path / "plain", expert_format="int4")
    weighted = moepass.convert(source, tmp_path / "weighted", expert_format="int4", imatrix=tmp_path / "m.dat")
    assert _weighted_errors(weighted.output_dir, source, matrices) < 0.9 * _weighted_errors(plain.output_dir, source,
                                                                                           matrices)
    # exact repacks do not change with an importance matrix
    a = moepass.convert(make_gguf("q4_0"), tmp_path / "a")
    b = moepass.convert(make_gguf("q4_0"), tmp_path / "b", imatrix=tmp_path / "m.dat")
    assert (a.output_dir / "model.onnx.data").read_bytes() == (b.output_dir / "model.onnx.data").read_bytes()


def test_bad_importance_files(tmp_path, make_gguf):
    matrices = _importance(make_gguf)
    write_dat(tmp_path / "m.dat", matrices)
    (tmp_path / "short.dat").write_bytes((tmp_path / "m.dat").read_bytes()[:300])
    with pytest.raises(moepass.MoepassError, match="short.dat: truncated importance matrix"):
        load_imatrix(tmp_path / "short.dat")
    with pytest.raises(moepass.MoepassError, match="not an importance matrix \\(general.type is None\\)"):
        load_imatrix(make_gguf("q4_0"))
    with pytest.raises(moepass.MoepassError, match=r"missing.dat: no such file or directory \(the importance matrix\)"):
        load_imatrix(tmp_path / "missing.dat")
    wrong = {name: values[:, :128] for name, values in matrices.items()}
    write_dat(tmp_path / "wrong.dat", wrong)
    with pytest.raises(moepass.MoepassError, match="importance matrix entry 'blk.0.ffn_gate_exps.weight' has 1024 "
                                                   "values, not 256 columns for one matrix or 8"):
        moepass.convert(make_gguf("q4_k"), tmp_path / "out", imatrix=tmp_path / "wrong.dat", expert_format="qmoe")
    assert not (tmp_path / "out").exists()
