"""Degenerate sampling parameters and non-finite logits fall back to the argmax instead of raising."""

import pytest
import torch

from worker.layers.sampler import sample
from worker.sequence import SamplingParams


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),
        SamplingParams(top_p=1e-300),
        SamplingParams(temperature=1e-40, top_p=1e-300, top_k=3),
    ],
)
def test_degenerate_parameters_give_the_argmax(params):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [9.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [params, params], [None, None]) == [1, 0]


def test_non_finite_logits_fail_only_their_own_row():
    logits = torch.tensor([[float("nan"), 1.0, 5.0, float("nan")], [0.0, 0.0, 50.0, 0.0]])
    params = SamplingParams(temperature=0.7)
    gen = torch.Generator().manual_seed(1)
    assert sample(logits, [params, params], [None, gen]) == [2, 2]
    all_nan = torch.full((1, 4), float("nan"))
    assert sample(all_nan, [params], [None])[0] in range(4)


def test_ordinary_sampling_still_draws_from_the_distribution():
    logits = torch.zeros((1, 4))
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, [params], [gen])[0] for _ in range(64)}
    assert draws == {0, 1, 2, 3}
