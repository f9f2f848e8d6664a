"""ONNX Runtime's CUDA SM80 fpA_intB ("shared") weight layout, in numpy.

QMoE with `weights_prepacked=1` (the layout the expert-offload backend requires for int4 block 32,
and which the CPU EP executes too) takes each expert matrix in the CUTLASS mixed-GEMM layout instead
of ORT's row-major codes. From ORT's storage (N rows of K codes, unsigned, zero point 8 or 128):
1. signed codes, transposed to K rows of N (two 4-bit codes per byte along N);
2. rows permuted within each MMA tile (16x8 for int8, 32 rows for int4: the ldmatrix order);
3. the sub-byte transpose of each (rows x columns) block of codes;
4. columns interleaved in tiles of 64 rows (4-way for int4, 2-way for int8);
5. codes re-biased to unsigned and interleaved within 32-bit registers.
The steps follow the documented order of ORT's packer (`permute_B_rows` -> `subbyte_transpose` ->
`interleave_column_major` -> `add_bias_and_interleave`); the result is checked byte for byte against
`onnxruntime.quantization.cuda_quantizer` in the tests.
"""

from __future__ import annotations

import numpy as np

_ROW_PERMUTATION = {
    8: np.array([0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]),
    4: np.array(
        [
            0,
            1,
            8,
            9,
            16,
            17,
            24,
            25,
            2,
            3,
            10,
            11,
            18,
            19,
            26,
            27,
            4,
            5,
            12,
            13,
            20,
            21,
            28,
            29,
            6,
            7,
            14,
            15,
            22,
            23,
            30,
            31,
        ]
    ),
}
_ACTIVATION_BITS = 16  # fp16 / bf16 activations


def _nibbles(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return u & np.uint8(0x0F), u >> np.uint8(4)


def prepack_problem(n: int, k: int, bits: int) -> str | None:
    """Why an [N, K] matrix of `bits`-bit codes cannot take the SM80 layout, or None when it can:
    K must fill whole MMA tiles (128/bits rows) and column-interleave tiles (64 rows, which also
    holds whole 32-bit registers of codes), N*bits/8 whole 8-byte columns."""
    rows_per_tile = 128 * 8 // _ACTIVATION_BITS
    if k % rows_per_tile or k % (8 * 16 // bits):
        return f"its input dimension {k} is not a multiple of {rows_per_tile}"
    if n * bits // 8 % 8:
        return f"its output dimension {n} is not a multiple of {64 // bits}"
    return None


def prepack_sm80(codes: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """ORT storage codes uint8 [N, K*bits/8] (unsigned) -> the SM80 layout, uint8 [K, N*bits/8]."""
    problem = prepack_problem(n, k, bits)
    if problem:
        raise ValueError(f"[{k}, {n}] cannot take the SM80 mixed-GEMM layout: {problem}")
    if bits == 4:
        low, high = _nibbles(codes.reshape(n, k // 2))
        unsigned = np.empty((n, k), dtype=np.uint8)
        unsigned[:, 0::2], unsigned[:, 1::2] = low, high
        signed_t = (unsigned.astype(np.int16) - 8).T  # [K, N]
        tensor = ((signed_t[:, 0::2] & 0x0F) | ((signed_t[:, 1::2] & 0x0F) << 4)).astype(np.uint8)
    else:
        tensor = np.ascontiguousarray((codes.reshape(n, k).astype(np.int16) - 128).T).astype(np.int8).view(np.uint8)
    rows, cols = tensor.shape  # K, N*bits/8

    # 1. permute rows within each MMA tile
    tile = 8 * 16 // bits
    permutation = _ROW_PERMUTATION[bits]
    tensor = tensor[(np.arange(rows) // tile) * tile + permutation[np.arange(rows) % tile]]

    # 2. sub-byte transpose: the [rows, cols] grid of codes becomes [cols', rows] and is re-packed
    if bits == 4:
        low, high = _nibbles(tensor)
        merged = np.stack([low.T, high.T], axis=1).reshape(2 * cols, rows)  # code rows: low then high
        tensor = (merged[:, 0::2] + merged[:, 1::2] * 16).astype(np.uint8).reshape(rows, cols)
    else:
        tensor = np.ascontiguousarray(tensor.T).reshape(rows, cols)

    # 3. interleave columns in tiles of 64 rows
    interleave = _ACTIVATION_BITS // bits
    rows_per_tile = 128 * 8 // _ACTIVATION_BITS
    per_int32 = 32 // bits
    tensor = tensor.reshape(-1, interleave, rows // rows_per_tile, rows_per_tile * 4 // per_int32)
    tensor = tensor.transpose(0, 2, 1, 3).reshape(rows, cols)

    # 4. unsigned codes, interleaved within 32-bit registers
    if bits == 8:
        biased = (tensor.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return np.ascontiguousarray(biased.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(rows, cols))
    low, high = _nibbles(tensor)
    merged = np.stack([low, high], axis=-1).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(rows, 2 * cols)
    merged = merged.astype(np.int16)
    merged = np.where(merged > 7, merged - 8, merged + 8)
    return (merged[:, 0::2] + merged[:, 1::2] * 16).astype(np.uint8)
