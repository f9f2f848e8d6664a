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


CHUNK, CHUNKS = 64, 4  # llama-imatrix's -c and --chunks: 256 tokens of held-out text


@pytest.mark.llama
def test_llama_imatrix_files_are_read_as_the_activations_they_hold(trained_models, tmp_path):
    """llama.cpp's own llama-imatrix (built from the oracle's source distribution, support.oracle.
    llama_tool) over held-out text on the text model: moepass reads its GGUF file as the mean squared
    input of each column of every matrix, per expert, which an independent float64 forward pass
    (support.reference_forward) over the same tokens gives too (llama.cpp in float32, its KV cache
    too and no flash attention: within 1e-4 relative, 2.2e-6 measured; with its default F16 cache
    1e-2; a token whose router nearly ties may take another expert there), an expert no token reached
    as 1, and its legacy .dat file as the same matrices (llama-quantize's reading of both: moepass read
    an unreached expert's row as 0 and the .dat file scaled by its call count before this test)."""
    import subprocess

    import hf_fixture
    from support.oracle import llama_cpp_module, llama_tool
    from support.reference_forward import Qwen3MoeReference

    source, _, _ = trained_models["text"]
    text = "\n\n".join(hf_fixture.texts()[1])
    (tmp_path / "text.txt").write_text(text)
    tool = llama_tool("llama-imatrix")
    for fmt in ("gguf", "dat"):
        done = subprocess.run([str(tool), "-m", str(source), "-f", str(tmp_path / "text.txt"), "-o",
                               str(tmp_path / f"m.{fmt}"), "--output-format", fmt, "-c", str(CHUNK), "-b", str(CHUNK),
                               "--chunks", str(CHUNKS), "--no-ppl", "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa",
                               "off"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    ours, legacy = load_imatrix(tmp_path / "m.gguf"), load_imatrix(tmp_path / "m.dat")
    # the tokens llama-imatrix ran: the text tokenized as it tokenizes it, in chunks from empty caches
    llama = llama_cpp_module().Llama(str(source), vocab_only=True, verbose=False)
    tokens = llama.tokenize(text.encode(), add_bos=True, special=False)
    add_bos = llama_cpp_module().llama_vocab_get_add_bos(llama_cpp_module().llama_model_get_vocab(llama.model))
    reference, squares, ties = Qwen3MoeReference(source), {}, 0
    for c in range(CHUNKS):
        chunk = list(tokens[c * CHUNK:(c + 1) * CHUNK])
        if add_bos:
            chunk[0] = llama.token_bos()
        reference.forward(chunk, squares)
        ties += reference.router_near_ties
    llama.close()
    assert set(ours) == set(squares) == set(legacy), (sorted(set(ours) ^ set(squares)), sorted(set(legacy) ^ set(ours)))
    written = {t.name: t.data.reshape(-1) for t in GGUFReader(tmp_path / "m.gguf").tensors}
    unreached = 0
    for name, (sums, counts) in squares.items():
        expected = sums / np.where(counts > 0, counts, 1)[:, None]
        got = ours[name].reshape(expected.shape)
        if len(counts) > 1:  # experts: the routed tokens counted alike but for near ties
            theirs = written[f"{name}.counts"]
            moved = np.abs(theirs - counts)
            assert moved.sum() <= 2 * ties, (name, theirs, counts, ties)
            same = moved == 0
        else:
            same = np.ones(1, bool)
        same &= counts > 0
        np.testing.assert_allclose(got[same], expected[same], rtol=1e-4, atol=1e-6 * expected.max(), err_msg=name)
        assert (got[counts == 0] == 1).all(), name  # never reached: 1, as llama-quantize takes it
        unreached += int((counts == 0).sum())
        np.testing.assert_allclose(legacy[name].reshape(got.shape), got, rtol=1e-6, err_msg=f"{name}: the .dat file")
    assert unreached > 0, "no expert went unreached: the rule for one is not tested"
