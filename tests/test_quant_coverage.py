"""Every GGUF type moepass accepts as experts: exact where the formats allow, else requantized with the
error measured; the converted model against llama.cpp on the same file.

Fixtures: the qwen3moe test model with gate/up/down experts of the type (other matrices Q8_0). Types
the gguf package cannot quantize get random codes with calibrated scale fields (make_fixtures).
Bound on |logit difference| at positions whose routing is decided (tests/oracle.py): 1.0. Measured:
0.04-0.07 for every type but Q5_K (0.43-0.56 at one position, depending on the requantizer's
rounding). The experts' requantization error is below 0.6 % (rel. RMS, int8 block 32), which moves
logits by a few hundredths; that Q5_K position is ill-conditioned as such: the exact float64 numpy
forward (tests/reference_forward.py) differs there from llama.cpp by 0.29 (elsewhere <= 0.04). Where routing
nearly ties, a token can take another expert under llama.cpp's activation quantization (0.45 for
Q4_1, 0.51 for Q4_K). Argmax: the same at every decided position, at least 40 % decided.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from moepass.quants import QUANT_TYPES
from moepass.runtime import load
from oracle import PROMPT, decided_positions, llama_logits, routing_near_ties

EXPERT_TYPES = [t for t, qt in QUANT_TYPES.items() if qt.storage != "float"]
EXACT = {GT.Q8_0, GT.Q4_0, GT.Q6_K, GT.Q5_0, GT.IQ4_NL, GT.MXFP4}
MAX_LOGIT_DIFF = 1.0
MAX_REQUANT_ERROR = 0.006


def test_every_listed_type_is_accepted():
    names = {t.name for t in EXPERT_TYPES}
    assert names >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                     "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4"}
    assert {t for t in EXPERT_TYPES if QUANT_TYPES[t].exact_forms()} == EXACT


@pytest.mark.parametrize("ggml_type", EXPERT_TYPES, ids=lambda t: t.name)
def test_type_converts_and_matches_llama_cpp(ggml_type, make_gguf, converted):
    kwargs = {"types": {"gate_up": ggml_type, "down": ggml_type}}
    out = converted("q8_0", **kwargs)
    report = json.loads((out / "moepass.json").read_text())
    experts = [w for w in report["weights"] if ".ffn_experts." in w["onnx_name"]]
    assert experts and all(w["source_types"] == [ggml_type.name] * len(w["sources"]) for w in experts)
    if ggml_type in EXACT:
        assert all(all(w["exact"]) for w in experts)
    else:
        errors = [e for w in experts for e in w["rel_rms_error"]]
        assert all(not any(w["exact"]) for w in experts) and 0 < max(errors) < MAX_REQUANT_ERROR

    ref = llama_logits(make_gguf("q8_0", **kwargs))
    decoder = load(out)
    ours, _ = decoder.forward(np.array([PROMPT]), decoder.empty_cache())
    ties = routing_near_ties(out)
    diff = float(np.abs(ours[0] - ref)[~ties].max())
    assert diff <= MAX_LOGIT_DIFF
    decided = decided_positions(ref, ties)
    assert decided.mean() >= 0.4
    same = ours[0].argmax(-1) == ref.argmax(-1)
    assert same[decided].all(), f"argmax differs at decided positions {np.flatnonzero(decided & ~same).tolist()}"
