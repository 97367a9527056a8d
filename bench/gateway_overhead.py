"""Gateway overhead: the same requests sent to the worker directly and through the gateway.

    python -m bench.gateway_overhead [--quick]

Starts one worker (``--model random-bench``: 32k context, random weights) and one gateway process on
SQLite in a temporary data dir, creates a tenant, then in one run, alternating request by request:

- direct: ``POST /v1/generate`` with token ids and namespace segments computed here exactly as the
  gateway computes them (so both paths hit the same cached blocks);
- gateway: ``POST /v1/completions`` with the text, so the gateway's auth, tokenizing, hashing,
  routing, worker call, response building and usage accounting are all in the measured time.

Both use ``max_tokens=1`` and greedy sampling. Added latency is the paired difference (gateway −
direct) of neighbouring requests, reported at p50 and p99, for a short prompt and an 8k-token prompt.

What tenants mostly send is ``POST /v1/chat/completions``: the same pairing for a chat request (system
prompt with a timestamp, tools, two turns) through three tenants whose canonicalization is ``off``,
``report`` and ``on``; the direct side sends the rendered conversation's token ids. Then requests per
second with 32 concurrent clients (short prompt), through the gateway and straight to the worker, and
their ratio (gateway ÷ direct: the share of the worker's throughput the gateway keeps). The last line
printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from bench.gateway_chat import CANONICALIZATION_MODES, CHAT_MESSAGES, CHAT_TOOLS
from gateway.model import ModelInfo, ModelRuntime
from gateway.up import free_port
from policies.isolation import namespace_segments

SALT = "bench-salt"
ADMIN_TOKEN = "bench-admin"
SHORT_PROMPT = "Summarize the following in one sentence: the quick brown fox jumps over the lazy dog."


def long_prompt(num_tokens: int) -> str:
    # The built-in tokenizers are byte-level: one ASCII character is one token.
    line = "Document line with some text about prefix caching and KV blocks. "
    return (line * (num_tokens // len(line) + 1))[: num_tokens - 1]


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def namespace_json(tenant_id: str) -> list[dict]:
    """The namespace segments the gateway sends for a ``namespace``-level tenant, as the worker reads them."""
    segments = namespace_segments(level="namespace", salt=SALT.encode(), tenant_id=tenant_id, epoch=0)
    return [
        {
            "start_token": s.start_token,
            "namespace_id": s.namespace_id,
            "key": s.key.hex(),
            "reserved_blocks": s.reserved_blocks,
        }
        for s in segments
    ]


class Bench:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        worker: str,
        gateway: str,
        key: str,
        tenant_id: str,
        runtime: ModelRuntime,
    ) -> None:
        self.session, self.worker, self.gateway, self.key = session, worker, gateway, key
        self.runtime = runtime
        self.namespace = namespace_json(tenant_id)
        self.counter = 0

    def for_tenant(self, key: str, tenant_id: str) -> Bench:
        """The same bench as another tenant (its key and namespace)."""
        return Bench(self.session, self.worker, self.gateway, key, tenant_id, self.runtime)

    def direct_body(self, prompt: str) -> dict:
        return self.direct_body_ids(self.runtime.encode_prompt(prompt))

    def chat_body(self) -> dict:
        text = self.runtime.render_chat(CHAT_MESSAGES, CHAT_TOOLS)
        return self.direct_body_ids(self.runtime.encode_chat(text))

    def direct_body_ids(self, token_ids: list[int]) -> dict:
        self.counter += 1
        return {
            "request_id": f"bench-{self.counter}",
            "prompt_token_ids": token_ids,
            "namespace": self.namespace,
            "stream": False,
            "cache": True,
            "sampling": {
                "max_tokens": 1,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 0,
                "seed": None,
                "stop": [],
                "stop_token_ids": [],
                "ignore_eos": True,
            },
        }

    async def direct(self, body: dict) -> float:
        payload = json.dumps(body).encode()
        started = time.perf_counter()
        async with self.session.post(
            self.worker + "/v1/generate", data=payload, headers={"Content-Type": "application/json"}
        ) as response:
            await response.read()
            assert response.status == 200, response.status
        return time.perf_counter() - started

    async def through_gateway_chat(self) -> float:
        payload = json.dumps(
            {
                "model": self.runtime.model_id,
                "messages": CHAT_MESSAGES,
                "tools": CHAT_TOOLS,
                "max_tokens": 1,
                "temperature": 0,
            }
        ).encode()
        started = time.perf_counter()
        async with self.session.post(
            self.gateway + "/v1/chat/completions",
            data=payload,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
        ) as response:
            await response.read()
            assert response.status == 200, (response.status, await response.text())
        return time.perf_counter() - started

    async def through_gateway(self, prompt: str) -> float:
        payload = json.dumps(
            {
                "model": self.runtime.model_id,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        started = time.perf_counter()
        async with self.session.post(
            self.gateway + "/v1/completions",
            data=payload,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
        ) as response:
            await response.read()
            assert response.status == 200, response.status
        return time.perf_counter() - started

    async def paired(self, prompt: str, num_pairs: int, num_warmup: int) -> dict:
        return await self._paired(
            self.direct_body(prompt), lambda: self.through_gateway(prompt), num_pairs, num_warmup
        )

    async def paired_chat(self, num_pairs: int, num_warmup: int) -> dict:
        return await self._paired(self.chat_body(), self.through_gateway_chat, num_pairs, num_warmup)

    async def _paired(self, body: dict, gateway_call, num_pairs: int, num_warmup: int) -> dict:
        # the direct body is tokenized once, outside the timed region
        for _ in range(num_warmup):
            await self.direct({**body, "request_id": f"warm-{self.counter}"})
            self.counter += 1
            await gateway_call()
        direct_ms, gateway_ms, added_ms = [], [], []
        for i in range(num_pairs):
            self.counter += 1
            request = {**body, "request_id": f"bench-{self.counter}"}
            if i % 2 == 0:  # alternate the order so drift does not favour one path
                d, g = await self.direct(request), await gateway_call()
            else:
                g, d = await gateway_call(), await self.direct(request)
            direct_ms.append(d * 1000)
            gateway_ms.append(g * 1000)
            added_ms.append((g - d) * 1000)
        return {
            "tokens": len(body["prompt_token_ids"]),
            "direct_p50_ms": statistics.median(direct_ms),
            "gateway_p50_ms": statistics.median(gateway_ms),
            "added_p50_ms": percentile(added_ms, 50),
            "added_p99_ms": percentile(added_ms, 99),
        }

    async def rps(self, concurrency: int, duration_s: float, *, direct: bool = False) -> float:
        done = 0
        deadline = time.perf_counter() + duration_s
        body = self.direct_body(SHORT_PROMPT)

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                if direct:
                    self.counter += 1
                    await self.direct({**body, "request_id": f"rps-{self.counter}"})
                else:
                    await self.through_gateway(SHORT_PROMPT)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


async def create_tenant(session: aiohttp.ClientSession, gateway: str, body: dict) -> dict:
    async with session.post(
        gateway + "/admin/v1/tenants", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as response:
        tenant = await response.json()
        assert response.status in (200, 201), tenant
        return tenant


async def run(worker: str, gateway: str, quick: bool) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tenant = await create_tenant(session, gateway, {"name": "bench"})
        async with session.get(worker + "/v1/info") as response:
            runtime = ModelRuntime(ModelInfo.from_json(await response.json()))
        bench = Bench(session, worker, gateway, tenant["api_key"], tenant["id"], runtime)
        phase = time.monotonic()
        short = await bench.paired(SHORT_PROMPT, 40 if quick else 300, 5)
        print(f"short prompt pairs: {time.monotonic() - phase:.1f} s", file=sys.stderr)
        phase = time.monotonic()
        long_8k = await bench.paired(long_prompt(8192), 12 if quick else 100, 2)
        print(
            f"8k prompt pairs (first one prefills 8k tokens): {time.monotonic() - phase:.1f} s",
            file=sys.stderr,
        )
        chat = {}
        for mode in CANONICALIZATION_MODES:
            phase = time.monotonic()
            tenant = await create_tenant(session, gateway, {"name": f"chat-{mode}", "canonicalization": mode})
            chat_bench = bench.for_tenant(tenant["api_key"], tenant["id"])
            chat[mode] = await chat_bench.paired_chat(40 if quick else 300, 5)
            print(f"chat pairs, canonicalization {mode}: {time.monotonic() - phase:.1f} s", file=sys.stderr)
        rps_32 = await bench.rps(32, 4 if quick else 15)
        rps_32_direct = await bench.rps(32, 4 if quick else 15, direct=True)
    return {
        "short": short,
        "long_8k": long_8k,
        **{f"chat_{m}": chat[m] for m in chat},
        "rps_32": rps_32,
        "rps_32_direct": rps_32_direct,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 60 s)")
    parser.add_argument("--model", default="random-bench")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pg-bench-") as tmp:
        data_dir = Path(tmp)
        env = {
            **os.environ,
            "PREFIXGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "PREFIXGATE_NAMESPACE_SALT": SALT,
            "PREFIXGATE_LOG_LEVEL": "WARNING",
            "PREFIXGATE_DATA_DIR": str(data_dir),
        }
        worker_port, gateway_port = free_port(), free_port()
        worker_url, gateway_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{gateway_port}"
        subprocess.run(
            [sys.executable, "-m", "gateway", "db", "upgrade"], env=env, check=True, stdout=subprocess.DEVNULL
        )
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker",
                    "--model",
                    args.model,
                    "--port",
                    str(worker_port),
                    "--max-num-seqs",
                    "64",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway",
                    "gateway",
                    "--port",
                    str(gateway_port),
                    "--worker-url",
                    worker_url,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        ]
        try:
            wait_http(worker_url + "/healthz", processes[0])
            wait_http(gateway_url + "/healthz", processes[1])
            print(f"worker and gateway up after {time.monotonic() - started:.1f} s", file=sys.stderr)
            result = asyncio.run(run(worker_url, gateway_url, args.quick))
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(30)
    print(
        f"{'prompt':<12}{'tokens':>8}{'direct p50':>12}{'gateway p50':>13}{'added p50':>11}{'added p99':>11}"
    )
    names = ("short", "long_8k", *(f"chat_{mode}" for mode in CANONICALIZATION_MODES))
    for name in names:
        r = result[name]
        print(
            f"{name:<12}{r['tokens']:>8}{r['direct_p50_ms']:>10.2f}ms{r['gateway_p50_ms']:>11.2f}ms"
            f"{r['added_p50_ms']:>9.2f}ms{r['added_p99_ms']:>9.2f}ms"
        )
    ratio = result["rps_32"] / result["rps_32_direct"]
    print(
        f"requests/s at 32 concurrent clients: gateway {result['rps_32']:.1f}, direct "
        f"{result['rps_32_direct']:.1f}, gateway ÷ direct {ratio:.3f}"
    )
    print(
        f"(model {args.model}, {'quick' if args.quick else 'full'} run, {time.monotonic() - started:.0f} s)"
    )
    summary = {
        name: {
            "added_p50_ms": round(result[name]["added_p50_ms"], 3),
            "added_p99_ms": round(result[name]["added_p99_ms"], 3),
        }
        for name in names
    }
    throughput = {
        "rps_32": round(result["rps_32"], 1),
        "rps_32_direct": round(result["rps_32_direct"], 1),
        "rps_ratio_gateway_to_direct": round(ratio, 3),
    }
    print(json.dumps({**summary, **throughput}))


if __name__ == "__main__":
    main()
