"""Deterministic "sampling": output token i depends only on the prompt tokens, the sampling parameters that
change a real model's choice (temperature, top_p, top_k, seed, choice index) and i. A disaggregated run therefore
gives exactly the aggregated answer, and `max_tokens` only truncates it."""

from __future__ import annotations

from array import array

import xxhash

from simengine.request import Request

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9


def seed_key(
    prompt_token_ids: list[int],
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    index: int,
) -> int:
    """64-bit key of everything that decides the output. Greedy sampling (temperature 0) ignores the choice
    index and the seed, as a real greedy decode does."""
    greedy = temperature is not None and temperature <= 0.0
    extra = "g" if greedy else f"{temperature}|{top_p}|{top_k}|{seed}|{index}"
    h = xxhash.xxh3_64(array("q", prompt_token_ids).tobytes())
    h.update(extra.encode())
    return h.intdigest()


class Sampler:
    """Picks output tokens among `word_ids` (tokens that are whole words, so streamed text reads well); ends
    with EOS after a length drawn from the key (between 24 and 512 tokens) unless `ignore_eos`."""

    def __init__(self, word_ids: list[int], eos_token_id: int) -> None:
        self.word_ids = word_ids
        self.n = len(word_ids)
        self.eos = eos_token_id

    def natural_length(self, key: int) -> int:
        return 24 + (key >> 7) % 489

    def token_at(self, key: int, i: int) -> int:
        x = (key + (i + 1) * _GOLDEN) & _MASK
        x = ((x ^ (x >> 30)) * _MIX) & _MASK
        x ^= x >> 31
        return self.word_ids[x % self.n]

    def next_token(self, request: Request) -> int:
        i = len(request.output_token_ids)
        p = request.params
        if not p.ignore_eos and i >= p.min_tokens and i >= self.natural_length(p.seed_key):
            return self.eos
        return self.token_at(p.seed_key, i)
