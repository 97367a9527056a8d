"""CUDA paths: device pool, pinned host tier, copies on a side stream. Skipped without a GPU."""

import pytest
import torch

from tests.worker.conftest import prompt_of, run
from tests.worker.test_tiers import A, push_out_of_l1

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_l2_hits_on_cuda_give_identical_output(make_engine, dtype):
    engine = make_engine(device="cuda", dtype=dtype, num_blocks=24, l2_bytes=1 << 20)
    assert engine.runner.kv_cache.is_cuda and engine.store.l2.data.is_pinned()
    prompt = prompt_of(1, 80)
    expected, _, _ = await run(engine, "ref", prompt, use_cache=False)
    await run(engine, "first", prompt, segs=A)
    await push_out_of_l1(engine)
    got, usage, _ = await run(engine, "again", prompt, segs=A)
    assert got == expected
    assert usage["cached_tokens_by_source"]["l2"] > 0
