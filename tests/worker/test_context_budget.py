"""A model whose context does not fit the KV budget fails to start, saying what to set (as vLLM does)."""

import subprocess
import sys

import pytest

from worker.config import ContextDoesNotFit, WorkerConfig, context_that_fits


def test_the_context_that_fits_is_served_and_a_misfit_names_the_settings():
    fits = WorkerConfig(num_blocks=300)
    assert context_that_fits(fits, model_context_tokens=4096, num_blocks=300, bytes_per_block=1000) == 4096
    capped = WorkerConfig(num_blocks=64, max_model_len=1000)
    assert context_that_fits(capped, model_context_tokens=4096, num_blocks=64, bytes_per_block=1000) == 1000
    budget = WorkerConfig(kv_cache_bytes=64_000)
    with pytest.raises(ContextDoesNotFit) as misfit:
        context_that_fits(budget, model_context_tokens=8192, num_blocks=64, bytes_per_block=1000)
    message = str(misfit.value)
    assert (
        "8192" in message
        and "--max-model-len 1008" in message
        and "PREFIXGATE_WORKER_MAX_MODEL_LEN" in message
    )
    assert "--kv-cache-bytes to 513000" in message  # 512 blocks of 16 + the free one, 1000 bytes each
    too_long = WorkerConfig(num_blocks=64, max_model_len=2000)
    with pytest.raises(ContextDoesNotFit, match="--max-model-len"):
        context_that_fits(too_long, model_context_tokens=4096, num_blocks=64, bytes_per_block=1000)


def test_worker_process_refuses_to_start_with_a_clear_message():
    # Before: the worker silently served 1008 of the model's 4096 tokens.
    result = subprocess.run(
        [sys.executable, "-m", "worker", "--model", "random-tiny", "--num-blocks", "64", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "does not fit the KV cache" in result.stderr and "--max-model-len 1008" in result.stderr
    assert "Traceback" not in result.stderr
