"""Hugging Face tokenizer directories: their Jinja chat template is applied as transformers applies it."""

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.tokenizer import load_tokenizer, prompt_token_ids

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenizer_dir(tmp_path):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world the weather tool answers in celsius"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_jinja_template_with_tools(tmp_path):
    hf = load_tokenizer(tokenizer_dir(tmp_path))
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    text = hf.apply_chat_template([{"role": "user", "content": "hello"}], tools=tools)
    expected_tools = json.dumps(tools, ensure_ascii=False)
    assert text == f"<s><|user|>\nhello\n<|tools|>{expected_tools}\n<|assistant|>\n"
    body = {"messages": [{"role": "user", "content": "hello"}], "tools": tools}
    assert prompt_token_ids(hf, "chat.completions", body) == [hf.encode(text)]
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "x\n"
    )
