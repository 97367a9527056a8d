"""Constrained decoding: a random model, sampling freely, still answers JSON that fits the schema."""

import json

import pytest
import torch

from tests.worker.conftest import prompt_of, run
from worker.engine import RequestError
from worker.sequence import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_json_schema_output_parses_and_fits(make_engine, seed):
    engine = make_engine()
    params = SamplingParams(
        max_tokens=200, temperature=1.0, seed=seed, grammar={"type": "json_schema", "schema": SCHEMA}
    )
    tokens, usage, text = await run(engine, f"js{seed}", prompt_of(seed, 20), params=params)
    value = json.loads(text)  # the grammar ended the request when the object closed
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert usage["completion_tokens"] == len(tokens) < 200


async def test_json_object_and_a_free_request_in_the_same_batch(make_engine):
    engine = make_engine()
    json_params = SamplingParams(max_tokens=120, temperature=1.0, seed=5, grammar={"type": "json_object"})
    free = SamplingParams(max_tokens=120, temperature=1.0, seed=5, ignore_eos=True)
    (_, _, text), (_, _, free_text) = [
        await run(engine, "obj", prompt_of(7, 20), params=json_params),
        await run(engine, "free", prompt_of(7, 20), params=free),
    ]
    assert isinstance(json.loads(text), dict)
    with pytest.raises(ValueError):
        json.loads(free_text)  # the same model without a grammar: not JSON


async def test_a_grammar_that_does_not_compile_is_refused(make_engine):
    engine = make_engine()
    bad = SamplingParams(max_tokens=4, grammar={"type": "json_schema", "schema": {"type": "nonsense"}})
    with pytest.raises(RequestError, match="nonsense"):
        await run(engine, "bad", prompt_of(1, 10), params=bad)
    with pytest.raises(RequestError, match=r"grammar\.type"):
        await run(engine, "bad2", prompt_of(1, 10), params=SamplingParams(grammar={"type": "xml"}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_sampling_features_on_cuda(make_engine):
    """Penalties, logit bias, logprobs and the grammar mask with logits on the device."""
    engine = make_engine(device="cuda", dtype="bfloat16")
    biased = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((65, 100.0),), logprobs=2
    )
    tokens, _, _ = await run(engine, "bias", prompt_of(2, 20), params=biased)
    assert tokens == [65] * 6
    penalised = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=((66, 8.0),), frequency_penalty=2.0
    )
    tokens, _, _ = await run(engine, "pen", prompt_of(3, 20), params=penalised)
    assert 0 < tokens.count(66) < 12
    constrained = SamplingParams(
        max_tokens=200, temperature=1.0, seed=1, grammar={"type": "json_schema", "schema": SCHEMA}
    )
    _, _, text = await run(engine, "json", prompt_of(4, 20), params=constrained)
    assert set(json.loads(text)) == {"city", "population"}


def test_a_row_whose_grammar_allows_nothing_is_left_alone():
    """Masking a row to all -inf would make sampling fail for the whole batch (every tenant in it)."""
    from worker.structured import mask_logits

    class Exhausted:
        def is_error(self) -> bool:
            return False

        def compute_logit_bias(self) -> bytes:
            return bytes(4)

    logits = torch.zeros(2, 4)
    mask_logits(logits, [Exhausted(), None])
    assert torch.isfinite(logits).all()
