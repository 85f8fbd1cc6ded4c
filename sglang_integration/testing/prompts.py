"""The prompts the toolkit's engines decode, and the skewed ones whose routing drives EPLB.

``DEFAULT_PROMPTS``: 8 fixed prompts of 6 token ids each (below 64, the toolkit checkpoints'
vocabulary), the greedy passes every engine of the demo and the tests decodes.

``load_prompts(seed, step)``: what an engine runs a forward pass over before each rebalance so
that sglang's expert distribution recorder counts real top-k choices that differ from one
rebalance to the next. The default prompts' routing is the same at every pass (routing is by
logical expert, whatever the layout), so after the first rebalance it would ask for the same
layout again and no expert would move; each step's load prompts instead repeat a few tokens of
their own (drawn from ``(seed, step)``; an engine names its steps by its name and its count of
rebalances, so two engines on the same daemons ask for different layouts too), so a few experts
per layer are hot, and different ones at each step. The routing is real (sglang's ``TopK`` over
the model's router); only the choice of prompts is skewed.

``read_prompts(path)`` reads a prompts file (a JSON list of token-id lists), which is untrusted:
bounded in size, count and length, every id an int in the vocabulary.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 7, 12, 33, 5, 60),
    (42, 8, 19, 3, 27, 11),
    (9, 51, 2, 38, 14, 45),
    (23, 6, 61, 17, 30, 4),
    (55, 13, 36, 21, 48, 0),
    (16, 44, 10, 58, 25, 39),
    (31, 62, 20, 47, 15, 52),
    (28, 3, 57, 34, 41, 18),
)
DEFAULT_NEW_TOKENS = 32
MAX_PROMPTS = 64
MAX_PROMPT_TOKENS = 256
MAX_PROMPTS_FILE_BYTES = 1 << 20

# Each step's load: sequences of a few repeated tokens.
LOAD_SEQUENCES = 16
LOAD_TOKENS = 16
LOAD_HOT_TOKENS = 2


class PromptsError(ValueError):
    """A prompts file that cannot be decoded; the message says what is wrong."""


def load_prompts(seed: int, step: int | str, vocab_size: int) -> list[list[int]]:
    """Step ``step``'s skewed prompts (the module docstring): the same in every process."""
    rng = random.Random(f"load:{seed}:{step}")
    hot = rng.sample(range(vocab_size), LOAD_HOT_TOKENS)
    return [[rng.choice(hot) for _ in range(LOAD_TOKENS)] for _ in range(LOAD_SEQUENCES)]


def read_prompts(path: str | os.PathLike[str], vocab_size: int) -> list[list[int]]:
    """The prompts of a JSON file ``[[id, ...], ...]``, checked (``PromptsError``)."""
    file = Path(path)
    try:
        with open(file, "rb") as handle:
            data = handle.read(MAX_PROMPTS_FILE_BYTES + 1)
    except OSError as exc:
        raise PromptsError(f"cannot read the prompts file {file}: {exc.strerror}") from None
    if len(data) > MAX_PROMPTS_FILE_BYTES:
        raise PromptsError(f"{file} is larger than {MAX_PROMPTS_FILE_BYTES} bytes")
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise PromptsError(f"{file} is not JSON ({exc})") from None
    return checked_prompts(document, vocab_size, str(file))


def checked_prompts(document: object, vocab_size: int, where: str) -> list[list[int]]:
    if not isinstance(document, list) or not 1 <= len(document) <= MAX_PROMPTS:
        raise PromptsError(
            f"{where}: expected a JSON list of 1 to {MAX_PROMPTS} prompts, each a list of token ids"
        )
    prompts = []
    for index, prompt in enumerate(document):
        if not isinstance(prompt, list) or not 1 <= len(prompt) <= MAX_PROMPT_TOKENS:
            raise PromptsError(
                f"{where}: prompt {index} is not a list of 1 to {MAX_PROMPT_TOKENS} token ids"
            )
        for token in prompt:
            if not isinstance(token, int) or isinstance(token, bool):
                raise PromptsError(f"{where}: prompt {index} holds {_short(token)}, not a token id")
            if not 0 <= token < vocab_size:
                raise PromptsError(
                    f"{where}: prompt {index} holds token {token}, outside the model's "
                    f"vocabulary [0, {vocab_size})"
                )
        prompts.append(list(prompt))
    return prompts


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
