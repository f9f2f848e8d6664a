"""Rotary position embedding as llama.cpp applies it: the parameters ggml's rope_yarn takes (after
llama_context's YaRN corrections), deepseek2's attention magnitude, and LongRoPE's choice of factors
by the context llama.cpp pads to. Read from a GGUF by moepass.core.architectures.read_rope; the
tables are computed by moepass.passes.lower.rope."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding as llama.cpp applies it: the llama_context parameters (after its YaRN
    corrections) that ggml's rope_yarn takes. float32 values, as llama.cpp holds them."""

    base: float
    freq_scale: float = 1.0  # 1 / scaling factor ("linear" and "yarn")
    ext_factor: float = 0.0  # 1 for YaRN: mix extrapolated and interpolated angles
    attn_factor: float = 1.0  # llama.cpp's yarn_attn_factor
    n_ctx_orig: int = 0  # YaRN's original context length
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_log_mul: float = 0.0  # deepseek2's mscale_all_dim (rope.scaling.yarn_log_multiplier / 0.1)
    # LongRoPE (phimoe): the file's rope_factors_short / rope_factors_long.weight, one float32
    # divisor per rotated dimension pair (None: that tensor is absent); which one applies depends
    # on the context the model is built for (long_factors).
    factors_short: tuple[float, ...] | None = None
    factors_long: tuple[float, ...] | None = None

    def latent_attention_mscale(self) -> float:
        """deepseek2's YaRN magnitude for its attention scale (kq_scale = mscale^2 / sqrt(head)),
        as llama.cpp's deepseek2 graph derives it from attn_factor."""
        f32 = np.float32
        log_inverse = np.log(f32(1) / f32(self.freq_scale))
        original = f32(self.attn_factor) * (f32(1) + f32(0.1) * log_inverse)
        return float(original * (f32(1) + f32(0.1) * f32(self.yarn_log_mul) * log_inverse))

    @property
    def longrope(self) -> bool:
        return self.factors_short is not None or self.factors_long is not None

    def long_factors(self, context: int) -> bool:
        """Whether llama.cpp takes the long factors for a model run with n_ctx = `context`.

        llama.cpp chooses once per llama_context, by its size, not per position (src/llama-model.cpp,
        llama_model::get_rope_factors: rope_long if cparams.n_ctx_seq > hparams.n_ctx_orig_yarn, else
        rope_short; the phi3 graph phimoe uses, src/models/phi3.cpp, hands that tensor to
        ggml_rope_ext for every position). n_ctx_seq is n_ctx rounded up to a multiple of 256 (the
        llama_context constructor, src/llama-context.cpp: n_ctx = GGML_PAD(n_ctx, 256), one sequence),
        and n_ctx_orig_yarn is rope.scaling.original_context_length, else context_length
        (llama_model::load_hparams). So a model built for `context` positions takes the long factors
        at every position, those below the original context too, when that padded size exceeds it.
        """
        return llama_context_size(context) > self.n_ctx_orig

    def freq_factors(self, context: int) -> np.ndarray | None:
        """The LongRoPE factors llama.cpp applies at `context` (long_factors), float32; None: none
        (no LongRoPE, or the file lacks the chosen tensor: llama.cpp then passes no factors)."""
        chosen = self.factors_long if self.long_factors(context) else self.factors_short
        return None if chosen is None else np.array(chosen, dtype=np.float32)

    def describe(self, context: int) -> str | None:
        """The scaling in words, for a model built for `context` positions."""
        parts = []
        if self.ext_factor:
            parts.append(f"YaRN x{1 / self.freq_scale:g} (original context {self.n_ctx_orig})")
        elif self.freq_scale != 1.0:
            parts.append(f"linear x{1 / self.freq_scale:g}")
        if self.longrope:
            long, padded = self.long_factors(context), llama_context_size(context)
            which = "long" if long else "short"
            chosen = (
                f"{which} factors"
                if (self.factors_long if long else self.factors_short) is not None
                else f"no factors (the file lacks rope_factors_{which})"
            )
            sized = f"context {context}" + (f", {padded} in llama.cpp," if padded != context else "")
            parts.append(
                f"LongRoPE {chosen} at every position ({sized} {'>' if long else '<='} original "
                f"{self.n_ctx_orig}: llama.cpp chooses by the context, not per position)"
            )
        if self.attn_factor != 1.0 and not self.ext_factor:
            parts.append(f"attention factor {self.attn_factor:.6g}")
        return ", ".join(parts) or None


LLAMA_CONTEXT_PAD = 256  # llama_context's constructor (src/llama-context.cpp): n_ctx = GGML_PAD(n_ctx, 256)


def llama_context_size(n_ctx: int) -> int:
    """The context of one sequence llama.cpp (as llama-cpp-python 0.3.36 vendors it) makes of n_ctx:
    cparams.n_ctx_seq = GGML_PAD(n_ctx, 256)."""
    return -(-n_ctx // LLAMA_CONTEXT_PAD) * LLAMA_CONTEXT_PAD
