"""The local third-party OpenAI server (tests/upstreams.py) answers the real openai SDK:
``transformers serve`` on the built-in model exported as a Hugging Face checkpoint, offline, greedy."""

import pytest
import torch
from openai import AsyncOpenAI

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]
MAX_TOKENS = 24


@pytest.fixture
async def third_party(transformers_server):
    client = AsyncOpenAI(base_url=transformers_server.base_url, api_key="unused", max_retries=0, timeout=60)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def expected_text(hf_checkpoint) -> str:
    """transformers' own greedy answer on the checkpoint, in process."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, len(prompt) :], skip_special_tokens=True)


async def test_models_lists_the_checkpoint(third_party, transformers_server):
    models = await third_party.models.list()
    assert transformers_server.model_id in [m.id for m in models.data]


async def test_chat_non_streamed(third_party, transformers_server, expected_text):
    reply = await third_party.chat.completions.create(
        model=transformers_server.model_id, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected_text
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens <= MAX_TOKENS


async def test_chat_streamed(third_party, transformers_server, expected_text):
    stream = await third_party.chat.completions.create(
        model=transformers_server.model_id,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    deltas, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len([d for d in deltas if d]) > 1  # really streamed, token by token
    assert "".join(deltas) == expected_text
    assert finish in ("stop", "length")
