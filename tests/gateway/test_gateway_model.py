"""Rendering and tokenizing as the worker would: a real tokenizer.json built with `tokenizers`."""

import json
from dataclasses import replace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from gateway.model import ModelInfo, ModelRuntime, TemplateError

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' and loop.previtem is defined and loop.previtem.role == 'user' %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders, trainers

    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tools|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    info = ModelInfo.from_json(
        {
            "model_id": "tiny",
            "model_fingerprint": "ab" * 16,
            "block_size": 16,
            "max_model_len": 256,
            "tokenizer_json": byte_level_tokenizer_json(),
            "chat_template": CHAT_TEMPLATE,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": True,
            "prefill_tokens_per_s": 1000.0,
        }
    )
    return ModelRuntime(info)


def test_render_chat_with_tools(runtime: ModelRuntime):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"q": "<city>"}}}]
    text = runtime.render_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], tools
    )
    assert text.startswith("<s><|tools|>")
    assert json.dumps(tools) in text  # tojson keeps '<' unescaped, as Hugging Face's does
    assert text.endswith("<|user|>hello\n<|assistant|>")


def test_special_tokens_become_single_ids(runtime: ModelRuntime):
    ids = runtime.encode_chat(runtime.render_chat([{"role": "user", "content": "hello world"}], None))
    assert ids[0] == runtime.bos_token_id
    assert runtime._tokenizer.token_to_id("<|user|>") in ids and ids[-1] == runtime._tokenizer.token_to_id(
        "<|assistant|>"
    )
    assert runtime.decode(ids).endswith("<|assistant|>")


def test_completion_prompts_get_bos_once(runtime: ModelRuntime):
    ids = runtime.encode_prompt("the quick brown fox")
    assert ids[0] == runtime.bos_token_id and ids.count(runtime.bos_token_id) == 1
    assert runtime.with_bos(ids) == ids
    assert runtime.decode(ids[1:]) == "the quick brown fox"


def test_template_exceptions_and_sandbox(runtime: ModelRuntime):
    with pytest.raises(TemplateError, match="alternate"):
        runtime.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None)
    evil = ModelRuntime(
        ModelInfo.from_json(
            {
                "model_id": "evil",
                "model_fingerprint": "00",
                "block_size": 16,
                "max_model_len": 64,
                "tokenizer_json": runtime.info.tokenizer_json,
                "bos_token": None,
                "eos_token": None,
                "chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
            }
        )
    )
    with pytest.raises(TemplateError):
        evil.render_chat([{"role": "user", "content": "x"}], None)
    # A template's own Python errors (tojson of an undefined value: TypeError) are refusals too.
    crashing = ModelRuntime(replace(evil.info, chat_template="{{ messages[0].missing | tojson }}"))
    with pytest.raises(TemplateError, match="chat template failed"):
        crashing.render_chat([{"role": "user", "content": "x"}], None)


def test_model_without_template_refuses_chat(runtime: ModelRuntime):
    bare = ModelRuntime(
        ModelInfo.from_json(
            {
                "model_id": "bare",
                "model_fingerprint": "00",
                "block_size": 16,
                "max_model_len": 64,
                "tokenizer_json": runtime.info.tokenizer_json,
            }
        )
    )
    with pytest.raises(TemplateError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "x"}], None)
    assert bare.encode_prompt("hello")[0] != runtime.bos_token_id


def test_hugging_face_template_features():
    from gateway.model import compile_chat_template

    template = compile_chat_template(
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
        "{% else %}U:{{ m.content }}{% endif %}{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    text = template.render(
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
    )
    assert text == "U:uA:a4"
