"""Penalties, logit bias and logprobs: exact values on small tensors, then through the real engine."""

import math

import pytest
import torch

from tests.worker.conftest import greedy, prompt_of, run, segments
from worker.engine import RequestError
from worker.layers.logits_processors import apply_logit_bias, apply_penalties, token_logprobs
from worker.protocol import BadRequest, parse_generate, parse_sampling
from worker.sequence import SamplingParams


def test_penalties_follow_openais_formula():
    logits = torch.zeros(2, 5)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # untouched
    ]
    apply_penalties(logits, params, [[1, 1, 1, 3], [1, 2]])
    # token 1 seen 3 times: 3 * 0.25 + 0.5; token 3 once: 0.25 + 0.5; others unseen
    assert logits[0].tolist() == [0.0, -1.25, 0.0, -0.75, 0.0]
    assert logits[1].tolist() == [0.0] * 5


def test_negative_penalties_favour_repetition():
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [SamplingParams(presence_penalty=-1.0)], [[2]])
    assert logits[0].argmax().item() == 2


def test_logit_bias_adds_to_the_named_tokens_only():
    logits = torch.zeros(2, 4)
    apply_logit_bias(logits, [SamplingParams(logit_bias=((0, -100.0), (3, 5.0))), SamplingParams()])
    assert logits.tolist() == [[-100.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0]]


def test_logprobs_are_log_softmax_with_the_top_alternatives():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(logprobs=2), SamplingParams()]
    first, second = token_logprobs(logits, [1, 0], params)
    expected = torch.log_softmax(logits[0], dim=-1)
    assert second is None
    assert first is not None and first.token_id == 1
    assert math.isclose(first.logprob, expected[1].item(), rel_tol=1e-6)
    assert [token for token, _ in first.top] == [3, 2]
    assert math.isclose(first.top[0][1], expected[3].item(), rel_tol=1e-6)


def test_protocol_parses_and_checks_the_new_fields():
    params = parse_sampling(
        {"presence_penalty": 1, "frequency_penalty": -0.5, "logit_bias": {"7": 10, "2": -1}, "logprobs": 3}
    )
    assert params.presence_penalty == 1.0 and params.frequency_penalty == -0.5
    assert params.logit_bias == ((2, -1.0), (7, 10.0)) and params.logprobs == 3
    body = {
        "request_id": "chatcmpl-1",
        "prompt_token_ids": [1, 2],
        "namespace": [{"start_token": 0, "namespace_id": "t", "key": "00" * 16}],
        "x_request_id": "client-7",
    }
    assert parse_generate(body, 16).x_request_id == "client-7"  # the gateway's id, for the worker's logs
    for bad in (
        {"presence_penalty": 3},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"1": 101}},
        {"logprobs": 21},
    ):
        with pytest.raises(BadRequest):
            parse_sampling(bad)


async def test_engine_honours_logit_bias_and_rejects_ids_outside_the_vocabulary(make_engine):
    engine = make_engine()
    prompt = prompt_of(3, 20)
    forced, _, _ = await run(engine, "bias", prompt, params=greedy(6, logit_bias=((65, 100.0),)))
    assert forced == [65] * 6
    with pytest.raises(RequestError, match="logit_bias"):
        await run(engine, "badbias", prompt, params=greedy(2, logit_bias=((10**6, 1.0),)))


async def test_engine_frequency_penalty_changes_a_repetitive_greedy_output(make_engine):
    engine = make_engine()
    prompt = prompt_of(4, 20)
    # A bias makes token 66 the greedy choice; a frequency penalty of 2 per occurrence cannot beat +8 at
    # once, but after a few repetitions another token wins.
    plain, _, _ = await run(engine, "plain", prompt, params=greedy(12, logit_bias=((66, 8.0),)))
    penalised, _, _ = await run(
        engine, "pen", prompt, params=greedy(12, logit_bias=((66, 8.0),), frequency_penalty=2.0)
    )
    assert plain.count(66) == 12
    assert 0 < penalised.count(66) < 12


async def test_engine_reports_the_greedy_tokens_logprobs(make_engine):
    engine = make_engine()
    entries = []
    async for out in engine.generate("lp", prompt_of(5, 20), greedy(5, logprobs=3), segments()):
        entries += out.logprobs or []
        tokens = out.token_ids
    assert len(entries) == 5 and entries[-1]["token_id"] == tokens[-1]
    for entry in entries:
        assert len(entry["top"]) == 3
        assert entry["top"][0][0] == entry["token_id"]  # greedy: the chosen token is the likeliest
        assert entry["logprob"] == pytest.approx(entry["top"][0][1]) and entry["logprob"] <= 0.0


def test_masked_tokens_are_not_offered_as_alternatives():
    logits = torch.tensor([[0.0, float("-inf"), float("-inf"), 1.0]])
    (entry,) = token_logprobs(logits, [3], [SamplingParams(logprobs=4)])
    assert entry is not None and [token for token, _ in entry.top] == [3, 0]
