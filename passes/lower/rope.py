"""RoPE tables: the cos/sin that GroupQueryAttention rotates queries and keys by, as llama.cpp computes them."""

from __future__ import annotations

import numpy as np

from moepass.core.architectures import Rope
from moepass.core.errors import MoepassError


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
    f32 = np.float32
    half = head_dim // 2
    theta_scale = f32(np.power(f32(rope.base), f32(-2.0 / head_dim)))
    theta = np.empty((n_positions, half), dtype=np.float32)
    theta[:, 0] = np.arange(n_positions, dtype=np.float32)
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * theta_scale
    if freq_factors is not None:
        freq_factors = np.asarray(freq_factors, dtype=np.float32).reshape(-1)
        if freq_factors.size < half:  # ggml_rope_impl's GGML_ASSERT(c->ne[0] >= n_dims / 2)
            raise MoepassError(f"{freq_factors.size} RoPE frequency factors for {half} rotated dimension pairs")
        theta = theta / freq_factors[:half]  # float32, as ggml divides
    freq_scale, mscale = f32(rope.freq_scale), f32(rope.attn_factor)
    angles = theta * freq_scale
    if rope.ext_factor:
        low, high = yarn_correction_dims(head_dim, rope)
        y = (np.arange(half, dtype=np.float32) - low) / max(f32(0.001), high - low)
        ramp = (f32(1) - np.clip(y, f32(0), f32(1))) * f32(rope.ext_factor)
        angles = angles * (f32(1) - ramp) + theta * ramp
        mscale = mscale * (f32(1) + f32(0.1) * np.log(f32(1) / freq_scale))
    angles = angles.astype(np.float64)
    cos = (np.cos(angles).astype(np.float32) * mscale).astype(np.float32)
    sin = (np.sin(angles).astype(np.float32) * mscale).astype(np.float32)
    if not (np.isfinite(cos).all() and np.isfinite(sin).all()):  # metadata in range can still overflow float32
        raise MoepassError(f"the RoPE parameters ({rope}) give non-finite cos/sin tables")
    return cos, sin


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
