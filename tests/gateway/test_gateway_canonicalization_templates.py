"""Canonicalization ``on`` never turns a request that renders with ``off`` into a 400 (review r3, D3).

The note of moved values is one more message after the last user turn; chat templates that require
strictly alternating roles (Mistral, Gemma, Llama-2 families) refuse it. The gateway's own render path
(``RequestPipeline.render``) then renders the request as sent and counts the fragments as reported."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.canonicalization import CanonicalizationStep
from gateway.errors import InvalidRequest
from gateway.model import ModelInfo, ModelRuntime
from gateway.pipeline import RequestPipeline
from gateway.routing import RendezvousRouter
from gateway.schemas import parse_chat
from gateway.workers import WorkerPool
from tenancy.policy import TenantPolicy
from worker.model.loader import BUILTIN_DIR
from worker.tokenizer import BYTE_CHAT_TEMPLATE

# Mistral-7B-Instruct-v0.1's template (Gemma's and Llama-2's carry the same alternation check).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
BODY = {
    "model": "mistral-like",
    "messages": [
        {"role": "user", "content": "I ordered a lamp on 2026-11-29 and it has not arrived."},
        {"role": "assistant", "content": "Sorry to hear that. What is your order number?"},
        {"role": "user", "content": "It is 7731. When should it arrive?"},
    ],
}


def model(chat_template: str) -> ModelRuntime:
    return ModelRuntime(
        ModelInfo(
            model_id="mistral-like",
            model_fingerprint="00" * 16,
            block_size=16,
            max_model_len=4096,
            tokenizer_json=(BUILTIN_DIR / "tokenizer.json").read_text(),
            chat_template=chat_template,
            bos_token=None,
            eos_token=None,
            add_bos_token=False,
            prefill_tokens_per_s=None,
        )
    )


@pytest.fixture
async def pipe():
    async with aiohttp.ClientSession() as session:
        yield RequestPipeline(
            pool=WorkerPool(("http://127.0.0.1:9",), session),
            router=RendezvousRouter(),
            salt=b"s",
            default_max_tokens=16,
            affinity_blocks=4,
            prompt_steps=[CanonicalizationStep()],
        )


@pytest.mark.parametrize("note_role", ["user", "system"])
async def test_on_mode_renders_every_request_off_mode_renders(pipe, note_role):
    mistral, request = model(MISTRAL), parse_chat(BODY)
    off = pipe.render(TenantPolicy(tenant_id="tn_a", name="a", canonicalization="off"), request, mistral)
    on_policy = TenantPolicy(
        tenant_id="tn_a", name="a", canonicalization="on", canonicalization_note_role=note_role
    )
    on = pipe.render(on_policy, request, mistral)
    # The request as sent, the date counted as reported (as in "report"), not moved.
    assert on.token_ids == off.token_ids and on.request.messages == request.messages
    assert (on.num_moved, on.num_reported) == (0, 1)


async def test_a_template_that_takes_the_note_still_gets_the_rewrite(pipe):
    policy = TenantPolicy(tenant_id="tn_a", name="a", canonicalization="on")
    on = pipe.render(policy, parse_chat(BODY), model(BYTE_CHAT_TEMPLATE))
    assert (on.num_moved, on.num_reported) == (1, 0) and "[[1]]" in on.text


async def test_a_request_the_template_refuses_as_sent_is_still_a_400(pipe):
    body = {**BODY, "messages": [*BODY["messages"], {"role": "user", "content": "Again on 2026-11-30?"}]}
    policy = TenantPolicy(tenant_id="tn_a", name="a", canonicalization="on")
    with pytest.raises(InvalidRequest, match="must alternate"):
        pipe.render(policy, parse_chat(body), model(MISTRAL))
