"""Tokenizers shared by the coordinator and the simulated engine, so both count the same prompt token ids.

`load_tokenizer(path)` returns a Hugging Face tokenizer (a directory with `tokenizer.json` and, for chat, a
`tokenizer_config.json` carrying `chat_template`) or, without a path, a deterministic built-in tokenizer that needs
no files: ~1 token per common word, pairs of letters for other words and UTF-8 byte fallback, so every string
round-trips. `prompt_token_ids(tokenizer, api, body)` is what an engine tokenizes for an OpenAI request body.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from jinja2 import Template

__all__ = [
    "Tokenizer",
    "BuiltinTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "prompt_token_ids",
    "render_chatml",
]


class Tokenizer(Protocol):
    """What the mesh needs from a tokenizer."""

    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True
    ) -> str: ...


# ---------------------------------------------------------------------------------------------------------------
# Chat rendering without Jinja2 (ChatML, as Qwen models use; vLLM-Ascend's usual models are Qwen).


def _content_text(content: Any) -> str:
    """OpenAI message content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise ValueError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chatml(messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
    """Renders messages the ChatML way; tools are listed in a system block as JSON, one per line."""
    out: list[str] = []
    if tools:
        lines = "\n".join(json.dumps(t, separators=(",", ":"), sort_keys=True) for t in tools)
        out.append(f"<|im_start|>system\n# Tools\n<tools>\n{lines}\n</tools><|im_end|>\n")
    for message in messages:
        role = message.get("role")
        text = _content_text(message.get("content"))
        calls = message.get("tool_calls")
        if calls:
            text += "".join(
                "\n<tool_call>" + json.dumps(c, separators=(",", ":"), sort_keys=True) + "</tool_call>"
                for c in calls
            )
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# Built-in tokenizer.

# Common English words (each gets " word", "word", " Word" and "Word" ids), so that ordinary prose counts about
# one token per word as a real BPE does. Everything else splits into letter pairs, then single bytes.
_WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from or had by not word
but what some we can out other were all there when up use your how said an each she which do their time if will
way about many then them write would like so these her long make thing see him two has look more day could go
come did number sound no most people my over know water than call first who may down side been now find any new
work part take get place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand port large spell
add even land here must big high such follow act why ask men change went light kind off need house picture try
us again animal point mother world near build self earth father head stand own page should country found answer
school grow study still learn plant cover food sun four between state keep eye never last let thought city tree
cross farm hard start might story saw far sea draw left late run while press close night real life few north
open seem together next white children begin got walk example ease paper group always music those both mark
often letter until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready above
ever red list though feel talk bird soon body dog family direct pose leave song measure door product black short
numeral class wind question happen complete ship area half rock order fire south problem piece told knew pass
since top whole king space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull cold notice voice
unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean warm
free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay wheel
full force blue object decide surface deep moon island foot system busy test record boat common gold possible
plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes
distant fill east paint language among model server request token cache prefill decode engine latency
throughput memory data compute network cluster node queue batch stream response prompt answer user assistant
system message function tool value result error code file path time hello world please thank question explain
summarize write story about the quick brown fox jumps lazy dog is are was were be been being have has had do
does did will would shall should may might must can could
"""

# Pre-tokenisation as GPT-2 does it, with Python's `re` (letters are [^\W\d_]).
_PRETOKEN = re.compile(r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+""")
_LETTER_PAIRS = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]


class BuiltinTokenizer:
    """Deterministic BPE-like tokenizer with no files: ids 0-255 are bytes, then specials, letter pairs, words."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

    def __init__(self) -> None:
        pieces: list[bytes] = [bytes([b]) for b in range(256)]
        self._special_ids: dict[str, int] = {}
        for special in self.SPECIALS:
            self._special_ids[special] = len(pieces)
            pieces.append(special.encode())
        seen = set(pieces)
        words: list[str] = []
        for word in _WORDS.split():
            if word not in words:
                words.append(word)
        variants = [p for pair in _LETTER_PAIRS for p in (pair, " " + pair)]
        for word in words:
            variants += [word, " " + word, word.capitalize(), " " + word.capitalize()]
        variants += [" " + str(d) for d in range(10)] + [str(d) for d in range(10)]
        variants += ["\n", "\n\n", "  ", ".", ",", "?", "!", ":", ";", " (", ")", '"', " '", "'"]
        for text in variants:
            raw = text.encode()
            if raw not in seen:
                seen.add(raw)
                pieces.append(raw)
        #: Bytes of each id; decoding joins them.
        self._pieces = pieces
        self._ids: dict[bytes, int] = {p: i for i, p in enumerate(pieces)}
        #: Pre-token text -> ids; prompts repeat words, so encode is mostly dict hits.
        self._cache: dict[str, tuple[int, ...]] = {}
        self._max_piece = max(len(p) for p in pieces[256 + len(self.SPECIALS) :])
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")
        self.eos_token_id = self._special_ids["<|endoftext|>"]
        self.im_end_id = self._special_ids["<|im_end|>"]
        self.vocab_size = len(pieces)
        #: Ids the simulated engine generates from: whole words with a leading space (clean incremental text).
        self.word_ids = [self._ids[(" " + w).encode()] for w in words]

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        raw = piece.encode()
        ids: list[int] = []
        pos, n = 0, len(raw)
        lookup = self._ids
        while pos < n:
            for size in range(min(self._max_piece, n - pos), 0, -1):
                tid = lookup.get(raw[pos : pos + size])
                if tid is not None and (size > 1 or tid < 256):
                    ids.append(tid)
                    pos += size
                    break
        return tuple(ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids."""
        out: list[int] = []
        cache = self._cache
        chunks = self._special_re.split(text) if "<|" in text else (text,)
        for chunk in chunks:
            special = self._special_ids.get(chunk)
            if special is not None:
                out.append(special)
                continue
            pieces = _PRETOKEN.findall(chunk)
            found = list(map(cache.get, pieces))
            if None in found:
                for i, ids in enumerate(found):
                    if ids is None:
                        ids = found[i] = self._encode_piece(pieces[i])
                        if len(cache) < 200_000:
                            cache[pieces[i]] = ids
            out.extend(chain.from_iterable(cast("list[tuple[int, ...]]", found)))  # every None filled above
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 on their own become U+FFFD, as HF tokenizers do."""
        pieces = self._pieces
        try:
            raw = b"".join([pieces[i] for i in ids])
        except (IndexError, TypeError):
            raise ValueError(f"token id out of range [0, {self.vocab_size})") from None
        return raw.decode("utf-8", errors="replace")

    def id_to_piece(self, tid: int) -> str:
        """Text of one token id (for `/tokenize` token strings)."""
        return self._pieces[tid].decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True
    ) -> str:
        return render_chatml(messages, tools, add_generation_prompt)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face tokenizer directory.


class HFTokenizer:
    """A `tokenizers` tokenizer from a Hugging Face directory; chat templates via Jinja2 when it is installed,
    else ChatML (the template most served models use), which is exact only for ChatML models."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"tokenizer directory {path!r} has no tokenizer.json")
        self._tok = _HF.from_file(file)
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as fh:
                config = json.load(fh)
        self.chat_template: str | None = config.get("chat_template") if isinstance(config, dict) else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token")) or "<|endoftext|>"
        eos_id = self._tok.token_to_id(self.eos_token)
        self.eos_token_id = eos_id if eos_id is not None else 0
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._cache: dict[str, list[int]] = {}
        self._jinja: Template | None = None
        self._word_ids: list[int] | None = None

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if len(self._cache) < 4096 and len(text) < 4096:
                self._cache[text] = ids
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_piece(self, tid: int) -> str:
        return self._tok.id_to_token(tid) or ""

    @property
    def word_ids(self) -> list[int]:
        """Ids whose text is a plain word with a leading space, so generated text concatenates cleanly."""
        if self._word_ids is None:
            found = []
            for tid in range(min(self.vocab_size, 60_000)):
                text = self._tok.decode([tid])
                if len(text) >= 3 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
                    found.append(tid)
            self._word_ids = found or [self.eos_token_id]
        return self._word_ids

    def apply_chat_template(
        self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True
    ) -> str:
        template = self.chat_template
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template:
            return render_chatml(messages, tools, add_generation_prompt)
        if self._jinja is None:
            # As Hugging Face renders chat templates: a sandbox, trimmed blocks, non-ASCII kept by `tojson`.
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            self._jinja = env.from_string(template)
        for m in messages:
            _content_text(m.get("content"))  # validates
        return self._jinja.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token,
        )


def _raise(message: str) -> None:
    raise ValueError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


_BUILTIN: BuiltinTokenizer | None = None


def load_tokenizer(path: str | None) -> Tokenizer:
    """The Hugging Face tokenizer in directory `path`, or the shared built-in tokenizer when `path` is empty."""
    global _BUILTIN
    if path:
        return HFTokenizer(path)
    if _BUILTIN is None:
        _BUILTIN = BuiltinTokenizer()
    return _BUILTIN


# ---------------------------------------------------------------------------------------------------------------
# OpenAI request bodies -> prompt token ids.


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_ids(ids: list[int], vocab_size: int) -> list[int]:
    for t in ids:
        if t < 0 or t >= vocab_size:
            raise ValueError(f"Token id {t} is out of vocabulary")
    return ids


def prompt_token_ids(tokenizer: Tokenizer, api: str, body: dict) -> list[list[int]]:
    """Prompt token ids of an OpenAI request body, one list per prompt; `api` is "completions" or
    "chat.completions". Raises ValueError with an OpenAI-style message on invalid input."""
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    if api == "completions":
        if "prompt" not in body or body["prompt"] is None:
            raise ValueError("'prompt' is a required property")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt)]
        if _is_token_list(prompt):
            if not prompt:
                raise ValueError("Prompt cannot be empty")
            return [_check_ids(prompt, tokenizer.vocab_size)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [tokenizer.encode(p) for p in prompt]
            if all(_is_token_list(p) and p for p in prompt):
                return [_check_ids(p, tokenizer.vocab_size) for p in prompt]
        raise ValueError(
            "'prompt' must be a string, an array of strings, an array of tokens, or an array of token arrays"
        )
    if api == "chat.completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty array")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError("each message must be an object with a string 'role'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' must be an array")
        add_gen = body.get("add_generation_prompt", True)
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=bool(add_gen))
        return [tokenizer.encode(text)]
    raise ValueError(f"unknown api {api!r}")
