"""benchmarks/runtime.py's profile tables (docs/benchmarks.md, Where the time goes): the
multiply-adds and weight bytes it sets beside each operator's time are the model's own, counted
from the converted fixture's dimensions; ik_llama.cpp's perf symbols land in the right groups."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/runtime.py under a name of its own (a bare `runtime` would be the package folder)."""
    spec = importlib.util.spec_from_file_location("bench_runtime", ROOT / "benchmarks" / "runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operator_work_counts_the_models_own_multiply_adds_and_bytes(bench, converted):
    model_dir = converted("q4_0")
    hp = json.loads((model_dir / "moepass.json").read_text())["hparams"]
    layers, hidden, ff, experts, k = (hp[key] for key in ("n_layers", "hidden", "expert_ff", "n_experts",
                                                          "n_experts_used"))
    heads, kv_heads, head_dim, vocab = hp["n_heads"], hp["n_kv_heads"], hp["head_dim"], hp["vocab"]
    prompt = 37  # not a multiple of anything: the prefill's rows are the prompt's, the LM head's one
    work = bench.operator_work(model_dir, prompt)

    moe = work["QMoE"]
    assert moe["decode_macs"] == layers * k * (2 * ff * hidden + hidden * ff)  # gate and up, then down
    assert moe["prefill_macs"] == prompt * moe["decode_macs"]
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    sizes = {t.name: int({e.key: e.value for e in t.external_data}.get("length", len(t.raw_data)))
             for t in model.graph.initializer}
    stored = sum(sizes.get(i, 0) for n in model.graph.node if n.op_type == "QMoE" for i in n.input)
    assert moe["decode_bytes"] == pytest.approx(stored * k / experts, abs=layers)  # the top-k experts a step
    assert moe["prefill_bytes"] == pytest.approx(stored * (1 - (1 - k / experts) ** prompt))

    head = work["MatMulNBits (lm_head)"]
    assert head["decode_macs"] == head["prefill_macs"] == vocab * hidden  # the last position alone
    projections = layers * hidden * (heads * head_dim + 2 * kv_heads * head_dim) + layers * heads * head_dim * hidden
    assert work["MatMulNBits"]["decode_macs"] == projections
    assert work["MatMulNBits"]["prefill_macs"] == prompt * projections
    assert work["MatMul"]["decode_macs"] == layers * hidden * experts  # the routers, in float
    assert work["GatherBlockQuantized"]["prefill_bytes"] == prompt * work["GatherBlockQuantized"]["decode_bytes"]

    expert_bytes, other_bytes = bench.bytes_per_decode_step(model_dir)
    assert expert_bytes == int(moe["decode_bytes"])
    assert expert_bytes + other_bytes == int(sum(w["decode_bytes"] for w in work.values()))


@pytest.mark.parametrize("symbol, group", [
    ("(anonymous namespace)::mul_mat_q4_0_r8_q8_2<16>", "matrix multiply, q4_0_r8 weights"),
    ("(anonymous namespace)::mul_mat_iq4_xs_r8_q8_k_avx2<8>", "matrix multiply, iq4_xs_r8 weights"),
    ("(anonymous namespace)::mul_mat_qX_q8_Helper<(anonymous namespace)::Q8_0_1_Unpacker, (anonymous "
     "namespace)::AccumT<(anonymous namespace)::MinusType0, 8, true>, 8>", "matrix multiply, q8_0 weights"),
    ("(anonymous namespace)::mul_mat_Qx_Qy_MxN<(anonymous namespace)::QFT<float, 5>, (anonymous "
     "namespace)::QFT<float, 5> >", "matrix multiply, float or other"),
    ("(anonymous namespace)::mul_mat_Qx_Qy_MxN_fa4<(anonymous namespace)::QFT<float, 8>, (anonymous "
     "namespace)::QFT<unsigned short, 8> >", "attention (flash)"),
    ("iqk_convert_legacy_quants_q8_r8", "weights converted on the fly (to Q8_0_R8)"),
    ("quantize_row_q8_2_x4", "activations quantized"),
    ("ggml_compute_forward_fused_rms_norm", "norms"),
    ("ggml_barrier", "threads waiting (barrier)"),
    ("0x000000000001f7da", "other"),
])
def test_ik_llama_kernels_are_grouped_by_what_they_do(bench, symbol, group):
    assert bench.ik_group(symbol, kernel=False) == group
    assert bench.ik_group(symbol, kernel=True) == "operating system (page faults, scheduling)"


def test_the_side_by_side_row_adds_up_each_engines_parts(bench, capsys):
    """profile_summary: matrices are every weight-matrix operator (moepass) or kernel group (ik),
    their rate counts the model's multiply-adds only (not Q4_K's block offsets), the rest is what
    neither matrices nor attention took."""
    ours = {"prefill": {"step_ms": 100.0, "operators": {"QMoE": {"ms": 50.0}, "MatMulNBits": {"ms": 30.0},
                                                        "MatMul": {"ms": 4.0}, "GroupQueryAttention": {"ms": 6.0},
                                                        "Reshape": {"ms": 1.0}}},
            "decode": {"step_ms": 10.0, "operators": {"QMoE": {"ms": 4.0}, "MatMulNBits": {"ms": 5.0},
                                                       "GroupQueryAttention": {"ms": 0.5}}}}
    theirs = {"prefill": {"unit_ms": 60.0, "groups": {"matrix multiply, q4_0_r8 weights": 40.0,
                                                      "weights converted on the fly (to Q8_0_R8)": 2.0,
                                                      "attention (flash)": 8.0, "norms": 3.0}},
              "decode": {"unit_ms": 8.0, "groups": {"matrix multiply, q8_0_r8 weights": 7.0, "other": 0.5}}}
    work = {"QMoE": {"prefill_macs": 6e9}, "MatMulNBits": {"prefill_macs": 2e9},
            "MatMul (block offsets)": {"prefill_macs": 5e9}, "MatMul": {"prefill_macs": 0.4e9}}
    bench.profile_summary({"preset": "q", "profile": ours, "ik_profile": theirs, "work": work})
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| prefill", "| decode"))]
    # 8.4 GMAC over 84 ms of moepass's matrices and over 42 ms of ik_llama.cpp's
    assert rows[0] == "| prefill | 84.0 / 42.0 | 100 / 200 | 6.0 / 8.0 | 10.0 / 10.0 | 100.0 / 60.0 |"
    assert rows[1] == "| decode | 9.0 / 7.0 |  | 0.5 / 0.0 | 0.5 / 1.0 | 10.0 / 8.0 |"
