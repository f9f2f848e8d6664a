"""A chat turn's speed line, as `moepass chat` prints it after each answer (llama-cli's wording)."""
import re

# the generated tokens and their rate, the prompt's tokens, those computed, in ms and tokens/s
TURN_SPEED = re.compile(r"\[(stopped; )?(\d+) tokens, [\d.]+ tokens/s; prompt (\d+) tokens, (\d+) computed in \d+ ms "
                        r"\([\d.]+ tokens/s\)\]")


def turn_counts(stderr: str) -> tuple[int, int, int]:
    """The first turn's generated, prompt and computed token counts read from chat's stderr."""
    found = TURN_SPEED.search(stderr)
    assert found, f"no turn-speed line in chat's stderr:\n{stderr}"
    _, new, prompt, computed = found.groups()
    return int(new), int(prompt), int(computed)
