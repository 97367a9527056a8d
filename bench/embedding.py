"""The near-miss embedder: latency quiet and under CPU load, int8 vs fp32, quality, and fairness.

    python -m bench.embedding            # 300 heads
    python -m bench.embedding --quick    # 100

Heads are what the gateway embeds: realistic prompts (system prompts of a few tenants built from shared
templates, with dates and request ids) tokenized by the built-in model's tokenizer (the one the gateway
serves), cut to their first 128 tokens and decoded back, as ``gateway.near_miss`` does. Each head has a
near duplicate: the same prompt with another ticket id and date (a per-request span, like
``bench.routing``'s ``near_duplicate`` workload).

1. **Latency**, per head, the gateway's int8 ONNX embedder beside the fp32 sentence-transformers
   reference (alternating in blocks of 25 heads), once on the machine as it is ("as is") and once beside
   ``--load-procs`` busy processes (a controlled background load, like the routing bench's workers).
   The int8 path is timed twice: the compute alone (``embed_blocking``) and the path a routed request
   takes (``await embed(urgent=True)``: queue, thread hand-off, event-loop wake-up).
2. **Where the time goes** (int8): tokenizer, ``session.run``, pooling and normalisation, and the
   thread hand-off (an empty job through the urgent queue and back to the event loop).
3. **Quality**: recall@1 of near duplicates (is a variant's nearest head its own base?) and the lowest
   cosine with fp32, for ``max_seq_tokens`` 32 (the default) and shorter truncations.
4. **The routing bench's heads**: ``bench.routing``'s ``near_duplicate`` requests (token-id prompts,
   600), their 128-token heads decoded: recall of the right candidate (the tenant's earlier prompt
   sharing the longest prefix) per ``max_seq_tokens``, and every request's head through
   ``await embed(urgent=True)`` of a fresh embedder, as is and under load: model runs (the LRU serves
   heads whose word pieces the tenant had embedded already) and the per-request time.
5. **Batching**: ms per head when several heads share one ``session.run`` (padded, masked mean).
6. **Fairness**: a tenant floods ``--flood`` distinct heads into the background queue, then a quiet
   tenant asks for one; the quiet tenant's wait with one shared queue (embeddings submitted without a
   tenant: one FIFO, no cap) and with per-tenant queues (round-robin, capped), and the latency of the
   quiet tenant's urgent embeddings (arriving at random moments) while the background thread works
   through the flood; once more with the background thread at normal priority (nice 0).

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from bench.gateway_overhead import percentile
from gateway.embedding import UNATTRIBUTED, EmbeddingShed, PromptEmbedder

ROOT = Path(__file__).resolve().parents[1]
HEAD_TOKENS = 128  # gateway.near_miss: the head it decodes and embeds

COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Stark", "Wayne", "Tyrell"]
ROLES = ["billing", "support", "legal", "travel", "HR", "sales", "security", "shipping", "onboarding"]
TASKS = [
    "Answer in JSON with the invoice id and the total.",
    "Summarize the ticket for the on-call engineer, then list the next actions.",
    "Answer only from the documents below; say so when they do not cover the question.",
    "Be brief and polite; never promise refunds above 100 EUR without a manager.",
    "Translate the customer's message to English before you answer it.",
    "Use the tools to look up the order before you answer; never invent tracking numbers.",
    "Write SQL for PostgreSQL 16 only; explain each query in one sentence.",
    "Classify the email as spam, sales, support or other and give a confidence.",
]
DOCS = ["The warranty covers two years.", "Returns are free within 30 days.", "Support runs 24/7."]


def prompt_heads(count: int, seed: int = 11) -> tuple[list[str], list[str]]:
    """``count`` distinct heads and a near duplicate of each (the same prompt with another ticket id and
    date: a per-request span), decoded like the gateway decodes them."""
    tokenizer = Tokenizer.from_file(str(ROOT / "worker" / "builtin" / "tokenizer.json"))
    rng = random.Random(seed)

    def head(text: str) -> str:
        return tokenizer.decode(tokenizer.encode(text).ids[:HEAD_TOKENS], skip_special_tokens=False)

    def span() -> str:
        return f"Ticket {rng.randrange(16**6):06x}, 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}."

    bases, variants, seen = [], [], set()
    while len(bases) < count:
        role, company = rng.choice(ROLES), rng.choice(COMPANIES)
        rest = f"{rng.choice(TASKS)} {rng.choice(TASKS)} Context: {rng.choice(DOCS)} {rng.choice(DOCS)}"
        if (role, company, rest[:60]) in seen:
            continue
        seen.add((role, company, rest[:60]))
        opening = f"You are the {role} assistant of {company} Corp."
        bases.append(head(f"{opening} {span()} {rest}"))
        variants.append(head(f"{opening} {span()} {rest}"))
    return bases, variants


@contextmanager
def cpu_load(procs: int):
    """``procs`` busy Python processes for the duration (the controlled background load)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(procs)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 2)


async def latency(fast: PromptEmbedder, reference: PromptEmbedder, heads: list[str], block: int = 25) -> dict:
    """Per-head times of int8 compute in this thread, int8 through the urgent queue and thread (the
    path a routed request takes) and fp32 compute, in alternating blocks of ``block`` heads (so all
    three see the same load over time, and each runs with its own model warm in the caches, as in a
    gateway that runs only one of them; head by head, fp32's weights evicted int8's between calls)."""
    compute, routed, fp32 = [], [], []

    async def int8_compute(text: str) -> None:
        fast.embed_blocking(text)

    async def int8_routed(text: str) -> None:
        await fast.embed(text, urgent=True, tenant="bench")

    async def fp32_compute(text: str) -> None:
        reference.embed_blocking(text)

    steps = [(int8_compute, compute), (int8_routed, routed), (fp32_compute, fp32)]
    for start in range(0, len(heads), block):
        for step, times in steps:
            for i, head in enumerate(heads[start : start + block], start):
                text = f"{head} #{i} {step.__name__}"  # distinct from every earlier call: no LRU hit
                started = time.perf_counter()
                await step(text)
                times.append(time.perf_counter() - started)
    return {
        "int8_p50_ms": ms(compute, 50), "int8_p99_ms": ms(compute, 99),
        "int8_routed_p50_ms": ms(routed, 50), "int8_routed_p99_ms": ms(routed, 99),
        "fp32_p50_ms": ms(fp32, 50), "fp32_p99_ms": ms(fp32, 99),
    }  # fmt: skip


async def hand_off(embedder: PromptEmbedder, count: int = 200) -> float:
    """Median ms of an empty job through the urgent queue and thread, back to the event loop."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await asyncio.wrap_future(embedder._urgent.submit("bench", time.perf_counter))
        times.append(time.perf_counter() - started)
        await asyncio.sleep(0.001)
    return ms(times, 50)


def breakdown(encoder, heads: list[str]) -> dict:
    """Median ms of each step of one int8 embedding (``OnnxEncoder.encode`` taken apart)."""
    steps: dict[str, list[float]] = {"tokenize": [], "session_run": [], "pool_normalize": []}
    for head in heads:
        t0 = time.perf_counter()
        encoding = encoder.tokenizer.encode(head)
        ids = np.asarray([encoding.ids], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        t1 = time.perf_counter()
        hidden = encoder.session.run(None, {k: v for k, v in feeds.items() if k in encoder.input_names})[0][0]
        t2 = time.perf_counter()
        vector = hidden.mean(axis=0)
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        t3 = time.perf_counter()
        for name, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            steps[name].append(seconds)
    return {f"{name}_ms": ms(values, 50) for name, values in steps.items()}


def encode_batch(encoder, texts: list[str]) -> np.ndarray:
    """Several heads in one ``session.run``: padded to the longest, mean over each head's own tokens."""
    encodings = [encoder.tokenizer.encode(text) for text in texts]
    width = max(len(e.ids) for e in encodings)
    ids = np.zeros((len(texts), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, encoding in enumerate(encodings):
        ids[row, : len(encoding.ids)] = encoding.ids
        mask[row, : len(encoding.ids)] = 1
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    hidden = encoder.session.run(None, {k: v for k, v in feeds.items() if k in encoder.input_names})[0]
    vectors = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def batching(encoder, heads: list[str], sizes=(1, 4, 8)) -> dict:
    result = {}
    for size in sizes:
        per_head = []
        for start in range(0, len(heads) - size + 1, size):
            started = time.perf_counter()
            encode_batch(encoder, heads[start : start + size])
            per_head.append((time.perf_counter() - started) / size)
        result[f"batch{size}_ms_per_head"] = ms(per_head, 50)
    return result


def recall_at_1(bases: np.ndarray, variants: np.ndarray) -> float:
    return round(float(np.mean(np.argmax(variants @ bases.T, axis=1) == np.arange(len(bases)))), 3)


def quality(model_dir: Path, cache_dir: Path, reference: PromptEmbedder, bases, variants) -> dict:
    """Per ``max_seq_tokens``: recall@1 of near duplicates (a variant's nearest base is its own), how
    often its nearest base is the one fp32 at 32 word pieces picks, and the cosine with fp32@32 (mean,
    lowest). Only bases that differ within the 32 word pieces the model reads are kept: two heads that
    differ only beyond them are one input to the model, and neither could be told apart."""
    from gateway.embedding_onnx import load_encoder

    words = load_encoder(model_dir, cache_dir, max_seq_tokens=32, threads=1).tokenizer
    keep = list({tuple(words.encode(text).ids): i for i, text in enumerate(bases)}.values())
    bases, variants = [bases[i] for i in keep], [variants[i] for i in keep]
    ref_b = np.stack([reference.embed_blocking(t) for t in bases])
    ref_v = np.stack([reference.embed_blocking(t) for t in variants])
    ref_top = np.argmax(ref_v @ ref_b.T, axis=1)
    result = {"fp32_32": {"heads": len(bases), "recall": recall_at_1(ref_b, ref_v), "agree_fp32_32": 1.0}}
    for tokens in (32, 28, 24, 16):
        encoder = load_encoder(model_dir, cache_dir, max_seq_tokens=tokens, threads=1)
        ours_b = np.stack([encoder.encode(t) for t in bases])
        ours_v = np.stack([encoder.encode(t) for t in variants])
        cosine = np.sum(ours_b * ref_b, axis=1)
        result[f"int8_{tokens}"] = {
            "heads": len(bases),
            "recall": round(recall_at_1(ours_b, ours_v), 3),
            "agree_fp32_32": round(float(np.mean(np.argmax(ours_v @ ours_b.T, axis=1) == ref_top)), 3),
            "mean_cosine": round(float(np.mean(cosine)), 4),
            "min_cosine": round(float(np.min(cosine)), 4),
            "p50_ms": ms([_timed(encoder.encode, t) for t in bases[:100]], 50),
        }
    return result


def routing_workload(model_dir: Path, cache_dir: Path, num_requests: int) -> tuple[list, list[str], dict]:
    """``bench.routing``'s ``near_duplicate`` requests, their heads (decoded like the gateway does), and
    per ``max_seq_tokens`` the recall of the *right* candidate: for each request whose tenant sent an
    earlier prompt sharing a block with it, is the nearest (by embedding) of the tenant's 16 latest
    prompts one sharing the longest prefix (what near miss routes to)?"""
    from bench.routing import BLOCK, workload
    from gateway.embedding_onnx import load_encoder

    tokenizer = Tokenizer.from_file(str(ROOT / "worker" / "builtin" / "tokenizer.json"))
    requests = workload("near_duplicate", num_requests, 0, prompts_per_tenant=10)
    heads = [tokenizer.decode(r.prompt[:HEAD_TOKENS], skip_special_tokens=False) for r in requests]

    def shared_blocks(a: list[int], b: list[int]) -> int:
        n = 0
        while (n + 1) * BLOCK <= min(len(a), len(b)) and a[: (n + 1) * BLOCK] == b[: (n + 1) * BLOCK]:
            n += 1
        return n

    recall = {}
    for tokens in (32, 16, 8):
        encoder = load_encoder(model_dir, cache_dir, max_seq_tokens=tokens, threads=1)
        vectors = {head: encoder.encode(head) for head in set(heads)}
        right = asked = 0
        for i, request in enumerate(requests):
            earlier = [j for j in range(i) if requests[j].tenant == request.tenant][-16:]
            best = max((shared_blocks(request.prompt, requests[j].prompt) for j in earlier), default=0)
            if best == 0:
                continue
            nearest = max(earlier, key=lambda j: float(vectors[heads[j]] @ vectors[heads[i]]))
            right += shared_blocks(request.prompt, requests[nearest].prompt) == best
            asked += 1
        recall[f"int8_{tokens}"] = {"asked": asked, "right_candidate": round(right / max(1, asked), 3)}
    return requests, heads, recall


async def routed_path(cache_dir: Path, requests, heads: list[str]) -> dict:
    """Every request's head through a fresh embedder, as the request path asks (``await embed(urgent)``,
    per tenant, in arrival order): how many the model computed and what each request waited."""
    embedder = PromptEmbedder(cache_dir=cache_dir)
    await embedder.warm_up()
    times = []
    for request, head in zip(requests, heads, strict=True):
        started = time.perf_counter()
        await embedder.embed(head, urgent=True, tenant=f"t{request.tenant}")
        times.append(time.perf_counter() - started)
    embedder.close()
    return {
        "requests": len(requests),
        "distinct_heads": len({(r.tenant, h) for r, h in zip(requests, heads, strict=True)}),
        "model_runs": embedder.model_runs,
        "p50_ms": ms(times, 50),
        "p99_ms": ms(times, 99),
    }


def _timed(fn, arg) -> float:
    started = time.perf_counter()
    fn(arg)
    return time.perf_counter() - started


async def fairness(cache_dir: Path, heads: list[str], flood: int, per_tenant: bool, nice: int = 10) -> dict:
    """A flooding tenant fills the background queue, then a quiet tenant asks; what the quiet one waits,
    and what its urgent embeddings take meanwhile (arriving at random moments, as requests do)."""
    embedder = PromptEmbedder(
        cache_dir=cache_dir, background_per_tenant=16 if per_tenant else 10**9, background_nice=nice
    )
    await embedder.warm_up()
    flooder = "flood" if per_tenant else UNATTRIBUTED  # today's callers pass no tenant: one queue
    quiet = "quiet" if per_tenant else UNATTRIBUTED
    finished: list[str] = []

    async def one(tenant: str, text: str, label: str, urgent: bool = False) -> float | None:
        started = time.perf_counter()
        try:
            await embedder.embed(text, urgent=urgent, tenant=tenant)
        except EmbeddingShed:
            return None
        finished.append(label)
        return time.perf_counter() - started

    flood_tasks = [
        asyncio.create_task(one(flooder, f"{heads[i % len(heads)]} flood {i}", "flood")) for i in range(flood)
    ]
    await asyncio.sleep(0)
    quiet_task = asyncio.create_task(one(quiet, f"{heads[0]} quiet", "quiet"))
    await asyncio.sleep(0.01)  # the background thread is busy with the flood
    rng, urgent = random.Random(5), []
    for i in range(8):
        await asyncio.sleep(rng.uniform(0, 0.008))
        urgent.append(await one(quiet, f"{heads[1 + i]} quiet urgent", "urgent", urgent=True))
    quiet_wait = await quiet_task
    waits = await asyncio.gather(*flood_tasks)
    embedder.close()
    before_quiet = finished[: finished.index("quiet")]
    return {
        "quiet_wait_ms": round(quiet_wait * 1000, 1),
        "flood_served_before_quiet": len(before_quiet) - before_quiet.count("urgent"),
        "urgent_p50_ms": ms(urgent, 50),
        "urgent_max_ms": ms(urgent, 100),
        "flood_shed": sum(w is None for w in waits),
    }


def table(console: Console, title: str, rows: dict[str, dict]) -> None:
    columns = list(dict.fromkeys(key for row in rows.values() for key in row))
    out = Table(title=title)
    out.add_column("")
    for column in columns:
        out.add_column(column, justify="right")
    for name, row in rows.items():
        out.add_row(name, *(str(row.get(column, "")) for column in columns))
    console.print(out)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="100 heads")
    parser.add_argument("--load-procs", type=int, default=2)
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--routing-requests", type=int, default=600, help="bench.routing near_duplicate")
    parser.add_argument("--cache-dir", type=Path, default=None, help="keep the exported graph here")
    args = parser.parse_args()
    count = 100 if args.quick else args.heads
    console = Console()
    bases, variants = prompt_heads(count)
    with tempfile.TemporaryDirectory(prefix="bench-embedding-") as tmp:
        cache_dir = args.cache_dir or Path(tmp)
        fast = PromptEmbedder(cache_dir=cache_dir)
        reference = PromptEmbedder(backend="sentence-transformers")
        await fast.warm_up()
        reference.embed_blocking("warm up")
        encoder = fast._encode_fn.__self__  # the OnnxEncoder behind the gateway's embedder
        results: dict = {"backend": fast.backend, "heads": count}
        load = f"load{args.load_procs}"
        results["as_is"] = await latency(fast, reference, bases)
        results["breakdown"] = {**breakdown(encoder, bases), "hand_off_ms": await hand_off(fast)}
        with cpu_load(args.load_procs):
            results[f"load{args.load_procs}"] = await latency(fast, reference, variants)
            results["breakdown_loaded"] = {
                **breakdown(encoder, variants),
                "hand_off_ms": await hand_off(fast),
            }
        requests, heads, results["routing_recall"] = routing_workload(
            fast._model_dir(), cache_dir, args.routing_requests
        )
        results["routing_path"] = {"as is": await routed_path(cache_dir, requests, heads)}
        with cpu_load(args.load_procs):
            results["routing_path"][load] = await routed_path(cache_dir, requests, heads)
        results["quality"] = quality(fast._model_dir(), cache_dir, reference, bases, variants)
        results["batching"] = batching(encoder, bases)
        results["fairness_one_queue"] = await fairness(cache_dir, bases, args.flood, per_tenant=False)
        results["fairness_per_tenant"] = await fairness(cache_dir, bases, args.flood, per_tenant=True)
        results["fairness_per_tenant_nice0"] = await fairness(
            cache_dir, bases, args.flood, per_tenant=True, nice=0
        )
        fast.close()
        reference.close()
    table(console, f"embedding latency ms, {count} heads", {"as is": results["as_is"], load: results[load]})
    table(console, "int8 step medians ms", {"as is": results["breakdown"], load: results["breakdown_loaded"]})
    table(console, "quality vs max_seq_tokens (near duplicates)", results["quality"])
    table(console, "bench.routing near_duplicate: right candidate", results["routing_recall"])
    table(console, "bench.routing near_duplicate heads through embed(urgent)", results["routing_path"])
    table(console, "batched session.run (int8)", {"ms per head": results["batching"]})
    table(
        console,
        f"fairness: {args.flood} flooding heads, then a quiet tenant",
        {
            "one queue": results["fairness_one_queue"],
            "per tenant": results["fairness_per_tenant"],
            "per tenant, bg nice 0": results["fairness_per_tenant_nice0"],
        },
    )
    as_is, loaded = results["as_is"], results[load]
    summary = {
        "int8_p50_ms": as_is["int8_p50_ms"],
        "int8_routed_p50_ms": as_is["int8_routed_p50_ms"],
        "fp32_p50_ms": as_is["fp32_p50_ms"],
        "loaded_int8_p50_ms": loaded["int8_p50_ms"],
        "loaded_int8_routed_p50_ms": loaded["int8_routed_p50_ms"],
        "loaded_fp32_p50_ms": loaded["fp32_p50_ms"],
        "under_5ms_as_is": as_is["int8_routed_p50_ms"] < 5,
        "under_5ms_loaded": loaded["int8_routed_p50_ms"] < 5,
        "quiet_wait_one_queue_ms": results["fairness_one_queue"]["quiet_wait_ms"],
        "quiet_wait_per_tenant_ms": results["fairness_per_tenant"]["quiet_wait_ms"],
        "urgent_during_flood_p50_ms": results["fairness_per_tenant"]["urgent_p50_ms"],
        "routing_heads_model_runs": results["routing_path"]["as is"]["model_runs"],
        "routing_heads_distinct": results["routing_path"]["as is"]["distinct_heads"],
        "routing_path_p50_ms": results["routing_path"]["as is"]["p50_ms"],
        "loaded_routing_path_p50_ms": results["routing_path"][load]["p50_ms"],
    }
    print(json.dumps({"results": results, "summary": summary}))


if __name__ == "__main__":
    asyncio.run(main())
