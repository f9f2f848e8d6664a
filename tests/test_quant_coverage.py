"""Every GGUF type moepass accepts as experts: exact where the formats allow, else requantized with the
error measured; the converted model against llama.cpp on the same file.

Fixtures: the qwen3moe test model with gate/up/down experts of the type (other matrices Q8_0). Types
the gguf package cannot quantize get random codes with calibrated scale fields (make_fixtures).
`--expert-format auto` takes requantized types to int4 block 32 where that was measured to keep
llama.cpp's fidelity on a trained model (QuantType.int4_agrees), else int8; the comparison with
llama.cpp runs at int8 (random codes are int4's worst case, see test_llama_oracle): requantization
error below 0.6 % (rel. RMS), and the converted model as close to the exact computation of the
file's weights as llama.cpp is (tests/oracle.py check_against_exact).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from moepass.core.quants import QUANT_TYPES
from moepass.runtime import load
from oracle import PROMPT, check_against_exact, dequantized_copy, llama_logits, routing_near_ties

EXPERT_TYPES = [t for t, qt in QUANT_TYPES.items() if qt.storage != "float"]
EXACT = {GT.Q8_0, GT.Q4_0, GT.Q6_K, GT.Q5_0, GT.IQ4_NL, GT.MXFP4}
MAX_REQUANT_ERROR = 0.006  # int8 block 32


def test_every_listed_type_is_accepted():
    names = {t.name for t in EXPERT_TYPES}
    assert names >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                     "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4"}
    assert {t for t in EXPERT_TYPES if QUANT_TYPES[t].exact_forms()} == EXACT


@pytest.mark.parametrize("ggml_type", EXPERT_TYPES, ids=lambda t: t.name)
def test_type_converts_and_matches_llama_cpp(ggml_type, make_gguf, converted, tmp_path):
    kwargs = {"types": {"gate_up": ggml_type, "down": ggml_type}}
    auto = json.loads((converted("q8_0", **kwargs) / "moepass.json").read_text())
    if ggml_type not in EXACT:  # requantized: int4 where measured to keep llama.cpp's fidelity
        requantized_form = "int4/b32" if QUANT_TYPES[ggml_type].int4_agrees else "int8/b32"
        assert {m["form"] for m in auto["moe_layers"]} == {requantized_form}
    # random codes are the requantizer's worst case for int4 (see test_llama_oracle): the pipeline at int8
    out = converted("q8_0", expert_format="int8", **kwargs)
    report = json.loads((out / "moepass.json").read_text())
    experts = [w for w in report["weights"] if ".ffn_experts." in w["onnx_name"]]
    assert experts and all(w["source_types"] == [ggml_type.name] * len(w["sources"]) for w in experts)
    if ggml_type in EXACT:
        assert all(all(w["exact"]) for w in experts)
    else:
        errors = [e for w in experts for e in w["rel_rms_error"]]
        assert all(not any(w["exact"]) for w in experts) and 0 < max(errors) < MAX_REQUANT_ERROR

    gguf = make_gguf("q8_0", **kwargs)
    theirs = llama_logits(gguf)
    exact = llama_logits(dequantized_copy(gguf, tmp_path / "exact.gguf"))
    decoder = load(out)
    ours, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    check_against_exact(ours[0], exact, theirs, ggml_type.name, routing_near_ties(out))
