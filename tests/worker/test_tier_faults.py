"""Tier faults while serving: a deleted L3 directory, a hung (SIGSTOPped) Redis."""

import asyncio
import contextlib
import shutil
import signal
import socket
import threading
import time

from tests.worker.conftest import greedy, prompt_of, run
from tests.worker.test_tiers import BLOCK_BYTES, A, push_out_of_l1
from worker.config import parse_args


async def test_deleted_l3_directory_is_recreated_and_requests_keep_succeeding(make_engine, tmp_path):
    root = tmp_path / "kv"
    engine = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, l3_dir=root, l3_min_free_bytes=0)
    prompt = prompt_of(2, 80)
    expected, _, _ = await run(engine, "ref", prompt, use_cache=False)
    await run(engine, "first", prompt, segs=A)
    await push_out_of_l1(engine)
    engine.store.wait_for_writes()
    assert list(root.rglob("*.kv"))
    shutil.rmtree(root)  # an operator (or tmp cleaner) deletes the cache directory under a running worker
    got, _, _ = await asyncio.wait_for(run(engine, "after-delete", prompt, segs=A), 30)
    assert got == expected  # the index still named the files: a miss, recomputed
    later = prompt_of(3, 80)
    await run(engine, "later", later, segs=A)
    await push_out_of_l1(engine)
    engine.store.wait_for_writes()
    assert list(root.rglob("*.kv")), "writes land in the recreated directory"
    disk = engine.stats()["tiers"]["l3"]
    assert disk["dir_recreated_total"] >= 1 and disk["accepting"] == 1
    _, usage, _ = await run(engine, "later-again", later, segs=A)
    assert usage["cached_tokens_by_source"].get("l3", 0) > 0


async def test_hung_redis_adds_bounded_latency_and_requests_succeed(make_engine, private_redis):
    port, server = private_redis
    engine = make_engine(
        num_blocks=24,
        l2_bytes=4 * BLOCK_BYTES,
        remote_url=f"redis://127.0.0.1:{port}/0",
        remote_pause_s=30.0,
    )
    await run(engine, "first", prompt_of(50, 80), segs=A)
    await push_out_of_l1(engine, 3)
    engine.store.wait_for_writes()
    server.send_signal(signal.SIGSTOP)  # hung, not down: connections open, nothing answers
    prompts = [prompt_of(60 + i, 80) for i in range(3)]
    expected = [(await run(engine, f"ref{i}", p, use_cache=False))[0] for i, p in enumerate(prompts)]
    started = time.monotonic()
    got = [
        (await asyncio.wait_for(run(engine, f"hung{i}", p, segs=A, params=greedy()), 30))[0]
        for i, p in enumerate([prompt_of(50, 80), *prompts])
    ]
    elapsed_s = time.monotonic() - started
    assert got[1:] == expected and len(got[0]) == 12
    assert elapsed_s < 10  # one timeout (250 ms by default), then the tier is paused
    remote = engine.stats()["tiers"]["remote"]
    assert remote["errors_total"] >= 1 and remote["available"] == 0


def test_tier_fault_settings_are_flags_and_environment(monkeypatch):
    monkeypatch.setenv("PREFIXGATE_WORKER_REMOTE_PAUSE_S", "2.5")
    config = parse_args(
        ["--remote-timeout-ms", "400", "--watchdog-timeout-s", "3.5", "--max-waiting-tokens", "9"]
    )
    assert config.remote_pause_s == 2.5 and config.remote_timeout_ms == 400
    assert config.watchdog_timeout_s == 3.5 and config.max_waiting_tokens == 9
    assert parse_args([]).remote_timeout_ms == 250


class SlowLink:
    """A TCP proxy in front of a real Redis that holds every reply ``delay_s``: a busy host's latency.

    ``round_trips`` counts the times a client spoke after its last reply (or first): each is a wait for
    Redis, however many commands one pipeline or script carries."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port, self.delay_s = target_port, delay_s
        self.round_trips = 0
        self._count_lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
                answered = [True]  # this connection's client has its replies: its next bytes are a new trip
                threading.Thread(
                    target=self._pump, args=(client, server, 0.0, answered, True), daemon=True
                ).start()
                threading.Thread(
                    target=self._pump, args=(server, client, self.delay_s, answered, False), daemon=True
                ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, delay_s: float, answered: list[bool], asks: bool
    ) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                time.sleep(delay_s)
                with self._count_lock:
                    if asks and answered[0]:
                        self.round_trips += 1
                    answered[0] = not asks
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


async def test_remote_tier_serves_through_a_slow_link_within_its_default_timeout(
    make_engine,
    kv_redis_url,
):
    """Issue 9: the remote tier's 50 ms timeout tripped on a busy host; a 100 ms reply is still a hit."""
    port = int(kv_redis_url.split(":")[2].split("/")[0])
    link = SlowLink(port, delay_s=0.1)
    try:
        slow_url = f"redis://127.0.0.1:{link.port}/{kv_redis_url.rsplit('/', 1)[1]}"
        producer = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=slow_url)
        prompt = prompt_of(77, 80)
        expected, _, _ = await run(producer, "ref", prompt, use_cache=False)
        await run(producer, "first", prompt, segs=A)
        await push_out_of_l1(producer)
        producer.store.wait_for_writes()
        consumer = make_engine(remote_url=slow_url)
        got, usage, _ = await run(consumer, "same-tenant", prompt, segs=A)
        assert got == expected
        # No timeout, no pause on either side (a write that timed out would also leave nothing to read).
        tiers = {"producer": producer.stats()["tiers"], "consumer": consumer.stats()["tiers"]}
        assert usage["cached_tokens_by_source"]["remote"] > 0, (usage, tiers)
        assert [t["remote"].get("errors_total", 0) for t in tiers.values()] == [0, 0], tiers
    finally:
        link.close()
