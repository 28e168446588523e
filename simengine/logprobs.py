"""Simulated log-probabilities in vLLM's response shapes (values are made up, structure and types are vLLM's).

A token's logprob and its top alternatives depend only on the sequence key and position (like the sampler), so a
repeated request gets the same numbers. Shapes (vLLM 0.32):
- completions `logprobs`: `{"text_offset": [int], "token_logprobs": [float|None], "tokens": [str],
  "top_logprobs": [{token text: float}|None]}`; each dict holds the sampled token then the top `k` others;
  with `echo` the prompt comes first, its first token with None;
- completions `prompt_logprobs` (echo with logprobs): `[None, {token id: {"logprob", "rank", "decoded_token"}}]`;
- chat `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
  with `top_logprobs` entries, the sampled token first.
"""

from __future__ import annotations

from collections.abc import Callable

_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15


def _draw(key: int, i: int, salt: int) -> int:
    x = (key ^ (i * _MIX) ^ (salt * 0xBF58476D1CE4E5B9)) & _MASK
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 29)


def token_logprob(key: int, i: int) -> float:
    """Log-probability of the token sampled at position `i`: between -8 and -0.1."""
    return -0.1 - (_draw(key, i, 1) % 7900) / 1000.0


def alternatives(key: int, i: int, k: int, chosen: int, vocab: list[int]) -> list[tuple[int, float, int]]:
    """`k` other tokens with higher logprobs than the sampled one: (token id, logprob, rank from 1)."""
    out: list[tuple[int, float, int]] = []
    base = token_logprob(key, i)
    j = 0
    while len(out) < k and j < 4 * k + 8:
        tid = vocab[_draw(key, i, 100 + j) % len(vocab)]
        j += 1
        if tid == chosen or any(t == tid for t, _, _ in out):
            continue
        out.append((tid, min(base + 0.05 * (k - len(out)), -0.01), len(out) + 1))
    return out


class LogprobsBuilder:
    """Builds the logprobs parts of one sequence's answer; `text_of` turns token ids into their text."""

    __slots__ = ("text_of", "vocab")

    def __init__(self, text_of: Callable[[list[int]], str], vocab: list[int]) -> None:
        self.text_of = text_of
        self.vocab = vocab

    def completion(
        self, key: int, tokens: list[int], start: int, k: int, offset: int, prompt: list[int] | None = None
    ) -> dict:
        """Completions `logprobs` for output tokens at positions `start`.. (and the echoed prompt first)."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        pieces: list[str] = []
        tops: list[dict | None] = []
        if prompt:
            for j, tid in enumerate(prompt):
                piece = self.text_of([tid])
                text_offset.append(offset)
                offset += len(piece)
                pieces.append(piece)
                if j == 0:
                    token_logprobs.append(None)
                    tops.append(None)
                    continue
                lp = token_logprob(~key & _MASK, j)
                token_logprobs.append(lp)
                tops.append(self._top_map(~key & _MASK, j, k, tid, lp))
        for j, tid in enumerate(tokens):
            piece = self.text_of([tid])
            lp = token_logprob(key, start + j)
            text_offset.append(offset)
            offset += len(piece)
            pieces.append(piece)
            token_logprobs.append(lp)
            tops.append(self._top_map(key, start + j, k, tid, lp))
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": pieces,
            "top_logprobs": tops,
        }

    def _top_map(self, key: int, i: int, k: int, tid: int, lp: float) -> dict:
        top = {self.text_of([tid]): lp}
        for alt, alp, _ in alternatives(key, i, k, tid, self.vocab):
            top.setdefault(self.text_of([alt]), alp)
        return top

    def prompt_logprobs(self, key: int, prompt: list[int], k: int) -> list[dict | None]:
        """Completions `prompt_logprobs` (with echo and logprobs): keyed by token id (as strings in JSON)."""
        out: list[dict | None] = [None]
        pkey = ~key & _MASK
        for j in range(1, len(prompt)):
            tid = prompt[j]
            lp = token_logprob(pkey, j)
            entry = {
                tid: {
                    "logprob": lp,
                    "rank": 2 + _draw(pkey, j, 7) % 900,
                    "decoded_token": self.text_of([tid]),
                }
            }
            for alt, alp, rank in alternatives(pkey, j, k, tid, self.vocab):
                entry.setdefault(alt, {"logprob": alp, "rank": rank, "decoded_token": self.text_of([alt])})
            out.append(entry)
        return out

    def chat(self, key: int, tokens: list[int], start: int, k: int) -> dict:
        """Chat `logprobs` for output tokens at positions `start`..; `k` entries of top_logprobs each."""
        content = []
        for j, tid in enumerate(tokens):
            text = self.text_of([tid])
            lp = token_logprob(key, start + j)
            top = [{"token": text, "logprob": lp, "bytes": list(text.encode())}]
            for alt, alp, _ in alternatives(key, start + j, max(k - 1, 0), tid, self.vocab):
                alt_text = self.text_of([alt])
                top.append({"token": alt_text, "logprob": alp, "bytes": list(alt_text.encode())})
            content.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top[:k]}
            )
        return {"content": content}
