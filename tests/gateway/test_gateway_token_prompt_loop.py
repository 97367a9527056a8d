"""One tenant's large token-id bodies do not hold the event loop (review r6 #2).

``prompt: [1] * 999_000`` is a 3 MB body that can only be a 400 (random-tiny's context window is 4,096
tokens). Main parsed it on the loop (~0.05 s) and then checked every id in Python (~0.2 s) before the
length was compared with the window: eight such bodies made another tenant's ``GET /v1/models`` wait
up to 2 s. Now the length is checked before any id is looked at, and a large body is parsed in the
tenant's share of the CPU pool. The test client shares the gateway's loop, so a loop gap measured here
is a time the gateway held it; the bounds are several times what the fix leaves, a fraction of main's.
"""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from openai import AsyncOpenAI

from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.schemas import parse_completion
from tests.gateway.conftest import create_tenant

HUGE_PROMPT = json.dumps({"model": "random-tiny", "prompt": [1] * 999_000, "max_tokens": 1})


async def max_loop_gap(stop: asyncio.Event) -> float:
    worst, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst


async def test_a_million_token_ids_are_refused_without_holding_the_loop(gateway):
    key = (await create_tenant(gateway))["api_key"]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    gaps = []
    for _ in range(5):
        stop = asyncio.Event()
        monitor = asyncio.create_task(max_loop_gap(stop))
        response = await gateway.post("/v1/completions", data=HUGE_PROMPT, headers=headers)
        body = await response.json()
        stop.set()
        gaps.append(await monitor)
        assert response.status == 400, body
        assert body["error"]["code"] == "context_length_exceeded"
        assert "999000" in body["error"]["message"] and "4096" in body["error"]["message"]
    assert min(gaps) < 0.1, f"the event loop was held {[round(g, 3) for g in gaps]} s per request"


async def test_one_tenants_token_id_bodies_do_not_stall_another_tenant(gateway):
    """Tenant A sends 8 such bodies at once; tenant B's cheapest call (GET /v1/models) meanwhile."""
    key_a = (await create_tenant(gateway, name="a"))["api_key"]
    key_b = (await create_tenant(gateway, name="b"))["api_key"]
    headers_a = {"Authorization": f"Bearer {key_a}", "Content-Type": "application/json"}
    headers_b = {"Authorization": f"Bearer {key_b}"}
    done = asyncio.Event()

    async def tenant_b() -> float:
        worst = 0.0
        while not done.is_set():
            started = time.perf_counter()
            response = await gateway.get("/v1/models", headers=headers_b)
            assert response.status == 200
            worst = max(worst, time.perf_counter() - started)
            await asyncio.sleep(0.01)
        return worst

    b = asyncio.create_task(tenant_b())
    await asyncio.sleep(0.1)
    answers = await asyncio.gather(
        *(gateway.post("/v1/completions", data=HUGE_PROMPT, headers=headers_a) for _ in range(8))
    )
    done.set()
    worst = await b
    assert [answer.status for answer in answers] == [400] * 8
    # main: 1.7-2 s on a 2-core machine; the fix leaves one JSON parse (~0.05 s) at a time on a thread
    assert worst < 0.5, f"tenant B's GET /v1/models took up to {worst:.2f} s while A's bodies were parsed"


def test_a_token_list_longer_than_the_window_is_refused_from_its_length():
    """Refused before any id is looked at: the ids past the window are not even checked to be ids."""
    body = {"model": "m", "prompt": [1] * 4096 + ["not an id"]}
    with pytest.raises(ContextLengthExceeded) as caught:
        parse_completion(body, max_prompt_ids=4096)
    assert caught.value.param == "prompt" and "4097" in caught.value.message
    assert parse_completion({"model": "m", "prompt": [1] * 4096}, max_prompt_ids=4096).prompt == (1,) * 4096
    with pytest.raises(ContextLengthExceeded):  # a batch of one
        parse_completion({"model": "m", "prompt": [[7, 8, 9]]}, max_prompt_ids=2)
    for bad in ([1, True], [1, -1], [1, 2.0]):  # within the window, each id is still checked
        with pytest.raises(InvalidRequest):
            parse_completion({"model": "m", "prompt": bad}, max_prompt_ids=4096)


async def test_a_long_token_id_prompt_for_an_unknown_model_is_a_404(gateway):
    """A token-id prompt longer than the largest window served, for a model not served here: main said
    400 context_length_exceeded (the bound of an unknown model is the largest window), where any other
    request for that model is a 404 model_not_found; the model is now looked at first."""
    key = (await create_tenant(gateway))["api_key"]
    sdk = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as unknown:
        await sdk.completions.create(model="gpt-9", prompt=[1] * 5000, max_tokens=1)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    with pytest.raises(openai.NotFoundError):  # short: the same answer as before
        await sdk.completions.create(model="gpt-9", prompt=[1] * 10, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as too_long:  # a served model keeps its 400
        await sdk.completions.create(model="random-tiny", prompt=[1] * 5000, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
