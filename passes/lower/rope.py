"""RoPE tables: the cos/sin that GroupQueryAttention rotates queries and keys by, as llama.cpp computes them.

rope_cache computes them in numpy; rope_tables writes the same computation into the graph, a few
dozen nodes on constants that ONNX Runtime folds when it loads the model, as llama.cpp computes its
own at load, so that the file does not hold the two [context, rotary / 2] tables (21 MB at a
40,960-token context; tests/test_architectures.py checks the two computations agree to the bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from moepass.core.errors import MoepassError
from moepass.core.rope import Rope

if TYPE_CHECKING:
    from moepass.passes.lower.graph_builder import GraphBuilder


def rope_cache(
    n_positions: int, head_dim: int, rope: Rope, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables `[n_positions, head_dim/2]` for RoPE, as ggml's rope (rope_yarn) computes them.

    The angles follow llama.cpp's float32 recurrence (theta_i = theta_{i-1} * base^(-2/d)), so the
    tables agree with llama.cpp's to the last bit of float32 for the positions tests reach. Scaling
    ("linear", YaRN) and YaRN's magnitude factor, in float32 as ggml does them: for YaRN each
    dimension pair mixes the interpolated angle (theta * freq_scale) and the original one along a
    ramp between the correction dimensions, and cos/sin are scaled by attn_factor * (1 + 0.1 ln s)
    (which GroupQueryAttention's rotation then applies to q and k).

    `freq_factors` (LongRoPE: Rope.freq_factors, one per dimension pair) divide each pair's angle
    before any scaling, as ggml_rope_cache_init (ggml/src/ggml-cpu/ops.cpp) passes theta / ff to
    rope_yarn as its extrapolated angle; attn_factor then scales cos/sin as above.
    """
    return rope_rows(np.arange(n_positions, dtype=np.float32), head_dim, rope, freq_factors)


def rope_rows(
    positions: np.ndarray, head_dim: int, rope: Rope, freq_factors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """rope_cache's rows for the float32 `positions` given."""
    f32 = np.float32
    half = head_dim // 2
    theta_scale, factors, freq_scale, ramp, mscale = _rope_terms(head_dim, rope, freq_factors)
    theta = np.empty((len(positions), half), dtype=np.float32)
    theta[:, 0] = positions
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * theta_scale
    if factors is not None:
        theta = theta / factors  # float32, as ggml divides
    angles = theta * freq_scale
    if ramp is not None:
        angles = angles * (f32(1) - ramp) + theta * ramp
    angles = angles.astype(np.float64)
    cos = (np.cos(angles).astype(np.float32) * mscale).astype(np.float32)
    sin = (np.sin(angles).astype(np.float32) * mscale).astype(np.float32)
    if not (np.isfinite(cos).all() and np.isfinite(sin).all()):  # metadata in range can still overflow float32
        raise MoepassError(f"the RoPE parameters ({rope}) give non-finite cos/sin tables")
    return cos, sin


def _rope_terms(
    head_dim: int, rope: Rope, freq_factors: np.ndarray | None
) -> tuple[np.float32, np.ndarray | None, np.float32, np.ndarray | None, np.float32]:
    """The position-independent terms of rope_cache, in float32: (theta_scale, the LongRoPE factors
    of the `head_dim` / 2 pairs or None, freq_scale, YaRN's ramp per pair or None, the factor cos
    and sin are scaled by)."""
    f32 = np.float32
    half = head_dim // 2
    theta_scale = f32(np.power(f32(rope.base), f32(-2.0 / head_dim)))
    factors = None
    if freq_factors is not None:
        factors = np.asarray(freq_factors, dtype=np.float32).reshape(-1)
        if factors.size < half:  # ggml_rope_impl's GGML_ASSERT(c->ne[0] >= n_dims / 2)
            raise MoepassError(f"{factors.size} RoPE frequency factors for {half} rotated dimension pairs")
        factors = factors[:half]
    freq_scale, mscale = f32(rope.freq_scale), f32(rope.attn_factor)
    ramp = None
    if rope.ext_factor:
        low, high = yarn_correction_dims(head_dim, rope)
        y = (np.arange(half, dtype=np.float32) - low) / max(f32(0.001), high - low)
        ramp = (f32(1) - np.clip(y, f32(0), f32(1))) * f32(rope.ext_factor)
        mscale = mscale * (f32(1) + f32(0.1) * np.log(f32(1) / freq_scale))
    return theta_scale, factors, freq_scale, ramp, f32(mscale)


def rope_tables(
    builder: GraphBuilder, n_positions: int, head_dim: int, rope: Rope, freq_factors: np.ndarray | None = None
) -> tuple[ir.Value, ir.Value]:
    """rope_cache's tables as graph values ("rope.cos_cache", "rope.sin_cache", in the builder's
    activation type): the same float32 operations in the same order on constants, the position
    column turned pair by pair (the recurrence), cos and sin in float64 rounded to float32 as
    numpy's. ONNX Runtime folds them into constants when the session loads (its default
    optimization level), so decoding reads them as it read stored tables. Refuses what rope_cache
    refuses, on the last position's row (every angle grows with the position)."""
    rope_rows(np.array([n_positions - 1], np.float32), head_dim, rope, freq_factors)  # the largest angles
    theta_scale, factors, freq_scale, ramp, mscale = _rope_terms(head_dim, rope, freq_factors)
    t, f32 = builder.tape, np.float32

    def const(name: str, value) -> ir.Value:
        return builder.const(f"rope.{name}", np.asarray(value, dtype=np.float32))

    column = t.op(
        "Unsqueeze",
        [
            t.op(
                "Range", [const("start", 0), const("positions", n_positions), const("step", 1)], name="rope.positions"
            ),
            builder.ints(1),
        ],
        name="rope.position_column",
    )
    columns = [column]
    scale = const("theta_scale", theta_scale)
    for i in range(1, head_dim // 2):
        columns.append(t.op("Mul", [columns[-1], scale], name=f"rope.theta.{i}"))
    theta = t.op("Concat", columns, {"axis": 1}, name="rope.theta")
    if factors is not None:
        theta = t.op("Div", [theta, const("freq_factors", factors)], name="rope.theta_factored")
    angles = (
        theta if freq_scale == f32(1) else t.op("Mul", [theta, const("freq_scale", freq_scale)], name="rope.scaled")
    )
    if ramp is not None:
        angles = t.op(
            "Add",
            [
                t.op("Mul", [angles, const("interpolated", f32(1) - ramp)], name="rope.interpolated"),
                t.op("Mul", [theta, const("ramp", ramp)], name="rope.extrapolated"),
            ],
            name="rope.angles",
        )
    wide = t.op("Cast", [angles], {"to": ir.DataType.DOUBLE}, name="rope.angles_double")
    tables = []
    for kind in ("cos", "sin"):
        table = t.op(
            "Cast",
            [t.op(kind.capitalize(), [wide], name=f"rope.{kind}")],
            {"to": ir.DataType.FLOAT},
            name=f"rope.{kind}_float",
        )
        if mscale != f32(1):
            table = t.op("Mul", [table, const("mscale", mscale)], name=f"rope.{kind}_scaled")
        if builder.act != ir.DataType.FLOAT:
            table = t.op("Cast", [table], {"to": builder.act}, name=f"rope.{kind}_act")
        table.name = f"rope.{kind}_cache"
        tables.append(table)
    return tables[0], tables[1]


def yarn_correction_dims(n_dims: int, rope: Rope) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims: the dimension range over which YaRN blends the two angles."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        return (
            f32(n_dims)
            * np.log(f32(rope.n_ctx_orig) / (f32(n_rot) * f32(2) * f32(np.pi)))
            / (f32(2) * np.log(f32(rope.base)))
        )

    start, end = np.floor(corr_dim(rope.beta_fast)), np.ceil(corr_dim(rope.beta_slow))
    return f32(max(0, start)), f32(min(n_dims - 1, end))
