import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.hashing import NamespaceSegment
from tests.kv_redis import kv_redis_url  # noqa: F401 - fixture
from tests.worker_process import free_port
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.sequence import SamplingParams


def segments(key: bytes = b"tenant-a" * 4, ns: str = "a") -> list[NamespaceSegment]:
    return [NamespaceSegment(start_token=0, namespace_id=ns, key=key)]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def run(
    engine: Engine,
    rid: str,
    prompt: list[int],
    *,
    params: SamplingParams | None = None,
    segs: list[NamespaceSegment] | None = None,
    use_cache: bool = True,
    owner: str = "",
) -> tuple[list[int], dict, str]:
    """Run one request to the end; returns (generated ids, usage, text). ``owner``: the tenant tag the
    gateway names (its prefetch lane and budget share; default the last segment's namespace)."""
    tokens: list[int] = []
    text = ""
    async for out in engine.generate(
        rid, prompt, params or greedy(), segs or segments(), use_cache=use_cache, owner=owner
    ):
        assert out.error is None, out.error
        tokens += out.token_ids
        text += out.text
        if out.finished:
            return tokens, out.usage or {}, text
    raise AssertionError("stream ended without a final output")


@pytest.fixture
def make_engine() -> Iterator:
    engines: list[Engine] = []

    def factory(**overrides) -> Engine:
        values = {"model": "random-tiny", "num_blocks": 64, "max_num_batched_tokens": 32, **overrides}
        if values.get("num_blocks"):  # small pools: serve the context they hold (a longer one fails to start)
            values.setdefault("max_model_len", (values["num_blocks"] - 1) * 16)
        config = WorkerConfig(**values)
        engine = Engine(config)
        engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % 251 for i in range(length)]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen]]:
    """A redis-server of this test's own (its port and process), which the test may stop, hang or kill."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    try:
        yield port, server
    finally:
        server.send_signal(signal.SIGCONT)  # in case the test hung it
        server.kill()
        server.wait(timeout=10)
