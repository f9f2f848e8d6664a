"""How the next token is chosen: the settings (`Sampling`, greedy by default) and llama-server's
defaults (`LLAMA_SERVER`); moepass.runtime.sampling applies them."""

from __future__ import annotations

import dataclasses
import math

from moepass.core.errors import MoepassError


# run, chat, serve: how the next token is chosen (moepass.runtime.sampling applies it)
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling settings. The defaults keep every token and change no logit: greedy decoding.
    `LLAMA_SERVER` holds llama-server's defaults."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        numbers = (
            self.temperature,
            self.top_p,
            self.min_p,
            self.repeat_penalty,
            self.presence_penalty,
            self.frequency_penalty,
        )
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers):
            raise MoepassError(f"invalid sampling settings {self}: every number must be finite")
        if (
            self.temperature < 0
            or self.top_k < 0
            or not 0 < self.top_p <= 1
            or not 0 <= self.min_p <= 1
            or self.repeat_penalty <= 0
            or self.repeat_last_n < 0
        ):
            raise MoepassError(
                f"invalid sampling settings {self}: temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                "0 <= min_p <= 1, repeat_penalty > 0, repeat_last_n >= 0"
            )

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        )


# llama-server's defaults (common/common.h, llama.cpp as vendored by llama-cpp-python 0.3.36)
LLAMA_SERVER = Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
