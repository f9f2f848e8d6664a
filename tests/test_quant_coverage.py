"""Every GGUF type moepass accepts as experts: exact where the formats allow, else requantized with the
error measured; the converted model against llama.cpp on the same file.

Fixtures: the qwen3moe test model with gate/up/down experts of the type (other matrices Q8_0). Types
the gguf package cannot quantize get random codes with calibrated scale fields (make_fixtures).
`--expert-format auto` keeps the exact form where one exists (with `exact`: Q6_K's block 16 too),
the affine types' own codes through block-sum features, and requantizes everything else into int8
at the largest block dividing the rows (block 128 here), with the error below MAX_REQUANT_ERROR; the converted model is as
close to the exact computation of the weights it stores (llama.cpp on an F32 file of them) as
llama.cpp is to that of the file's (tests/support/oracle.py check_against_exact). What a
requantization costs in fidelity is measured by KL divergence on trained models (tests/test_trained_agreement.py).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from moepass.core.quants import QUANT_TYPES
from moepass.runtime import load
from make_fixtures import rewrite_gguf
from support.oracle import PROMPT, check_against_exact, dequantized_copy, llama_logits, routing_near_ties
from support.stored import stored_matrices

EXPERT_TYPES = [t for t, qt in QUANT_TYPES.items() if qt.storage != "float"]
EXACT = {GT.Q8_0, GT.Q4_0, GT.Q6_K, GT.Q5_0, GT.IQ4_NL, GT.IQ4_XS, GT.MXFP4, GT.Q3_K}
# with exact=True; the others int8/b32
EXACT_FORM = {GT.Q4_0: "int4/b32", GT.Q6_K: "int8/b16", GT.Q3_K: "int4/b16"}
# The defaults of the others: the 5-bit affine types and Q4_1 keep their own codes in gate and up
# through block-sum features at 8 bits ("+sums", levels as measured), their down requantized into
# 8 bits; the other types int8 at block 128 (Q4_K too: a 4-bit down costs it KLD), except the types
# under 3 bits a weight (int4 block 32, where int8 would double their size for nothing the KL
# divergence shows: tests/test_trained_agreement.py; Q2_K too, at these rows of 256, where block
# 16's features would cost more than their 4 bits save: with Q3_K's down, at Qwen3-30B-A3B's sizes,
# int4/b16 with features, test_quants)
REQUANTIZED_FORM = {GT.Q4_1: "int8/b32+sums", GT.Q5_1: "int8/b32+sums",
                    GT.Q5_K: "int8/b32+sums",
                    **{t: "int4/b32" for t in (GT.Q2_K, GT.IQ2_XXS, GT.IQ2_XS, GT.IQ1_S, GT.IQ1_M)}}
# One step is a block's largest value / 127 (int8) or about / 7 (int4), so the error is about
# 1 / (127 sqrt(12)) or 1 / (7 sqrt(12)) of that largest value: under 1 % and 10 % of the values'
# RMS (measured int8 0.0037-0.0063, int4 0.022-0.074); gate and up kept through block-sum features
# are within 1/16 of the file's own rounding (quants.SUMS_SHARE_OF_OWN), under 1 % here
MAX_REQUANT_ERROR = {"int8": 0.01, "int4": 0.10, "sums": 0.01}


def test_every_listed_type_is_accepted():
    names = {t.name for t in EXPERT_TYPES}
    assert names >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                     "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4"}
    assert {t for t in EXPERT_TYPES if QUANT_TYPES[t].exact_forms()} == EXACT


@pytest.mark.parametrize("ggml_type", EXPERT_TYPES, ids=lambda t: t.name)
def test_type_converts_and_matches_llama_cpp(ggml_type, make_gguf, converted, tmp_path):
    kwargs = {"types": {"gate_up": ggml_type, "down": ggml_type}}
    exact = ggml_type in EXACT
    out = converted("q8_0", exact=exact, **kwargs)
    report = json.loads((out / "moepass.json").read_text())
    expected = EXACT_FORM.get(ggml_type, "int8/b32") if exact else REQUANTIZED_FORM.get(ggml_type, "int8/b128")
    assert {re.sub(r"\+sums x\d", "+sums", m["form"]) for m in report["moe_layers"]} == {expected}
    experts = [w for w in report["weights"] if ".ffn_experts." in w["onnx_name"]]
    assert experts and all(w["source_types"] == [ggml_type.name] * len(w["sources"]) for w in experts)
    if exact:
        assert all(all(w["exact"]) for w in experts)
    else:
        assert all(not any(w["exact"]) for w in experts)
        for w in experts:
            bound = MAX_REQUANT_ERROR["sums" if "+sums" in w["target"] else w["target"][:4]]
            assert 0 < max(w["rel_rms_error"]) < bound, w

    gguf = make_gguf("q8_0", **kwargs)
    theirs = llama_logits(gguf)
    file_exact = llama_logits(dequantized_copy(gguf, tmp_path / "exact.gguf"))
    stored = {name: values for values, name in stored_matrices(out)}
    stored_exact = file_exact if exact else llama_logits(rewrite_gguf(gguf, tmp_path / "stored.gguf", stored))
    decoder = load(out)
    ours, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    check_against_exact(ours[0], stored_exact, theirs, ggml_type.name, routing_near_ties(out), their_exact=file_exact)
