"""The shared tokenizer: round trips, BPE-like counts, chat template, OpenAI request bodies."""

import pytest

from tandem.tokenizer import load_tokenizer, prompt_token_ids

TOK = load_tokenizer(None)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "The quick brown fox.",
        "héllo 世界 🚀",
        "  spaces\n\nand\ttabs ",
        "x" * 50,
        "",
        "a'll b's",
    ],
)
def test_round_trip(text):
    assert TOK.decode(TOK.encode(text)) == text


def test_counts_look_like_bpe():
    text = "the model answers the question about the cache and the server " * 10
    words = len(text.split())
    assert words <= len(TOK.encode(text)) <= words * 1.2
    assert 2000 < TOK.vocab_size < 10000
    assert TOK.decode([TOK.eos_token_id]) == "<|endoftext|>"


def test_deterministic_and_shared():
    assert load_tokenizer(None) is TOK
    assert TOK.encode("same words here") == load_tokenizer(None).encode("same words here")


def test_special_tokens_are_single_ids():
    ids = TOK.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == TOK.encode("<|im_start|>")[0] and len(TOK.encode("<|im_start|>")) == 1


def test_completions_prompt_forms():
    assert prompt_token_ids(TOK, "completions", {"prompt": "hello"}) == [TOK.encode("hello")]
    assert prompt_token_ids(TOK, "completions", {"prompt": ["a b", "c"]}) == [
        TOK.encode("a b"),
        TOK.encode("c"),
    ]
    assert prompt_token_ids(TOK, "completions", {"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert prompt_token_ids(TOK, "completions", {"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": 5}, {"prompt": [1, "a"]}, {"prompt": []}, {"prompt": [10**9]}, {"prompt": [[1], []]}],
)
def test_completions_invalid(body):
    with pytest.raises(ValueError):
        prompt_token_ids(TOK, "completions", body)


def test_chat_template_and_tools():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    text = TOK.apply_chat_template(msgs)
    assert (
        text
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = prompt_token_ids(
        TOK, "chat.completions", {"messages": msgs, "tools": [{"type": "function"}]}
    )[0]
    plain = prompt_token_ids(TOK, "chat.completions", {"messages": msgs})[0]
    assert len(with_tools) > len(plain)
    with pytest.raises(ValueError):
        prompt_token_ids(TOK, "chat.completions", {"messages": []})
    with pytest.raises(ValueError):
        prompt_token_ids(TOK, "chat.completions", {"messages": [{"content": "no role"}]})


def test_hf_tokenizer_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    )
    tok.train_from_iterator(["hello world the cache server answers"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    hf = load_tokenizer(str(tmp_path))
    assert hf.eos_token_id == 0
    assert hf.decode(hf.encode("hello world")) == "hello world"
    ids = prompt_token_ids(hf, "chat.completions", {"messages": [{"role": "user", "content": "hello"}]})[0]
    assert ids[0] == hf.encode("<|im_start|>")[0]
