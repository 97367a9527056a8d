"""Decode cost of the OpenAI sampling features in the worker: logprobs, penalties with logit bias, and
constrained decoding (JSON schema), against plain sampling, side by side in one run.

    python -m bench.sampling_features [--quick] [--model builtin]

Each round runs every mode once, in turn (so machine noise hits them alike): ``batch`` concurrent
requests of one mode on the in-process engine, each generating up to ``max_tokens``. Per mode: the
median decode time per token of each request (usage ``decode_ms`` over its tokens after the first) and the
aggregate tokens per second of the round. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import replace

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from policies.hashing import NamespaceKey, NamespaceSegment
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.sequence import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 300},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}},
    },
    "required": ["title", "tags"],
    "additionalProperties": False,
}


def modes(max_tokens: int) -> dict[str, SamplingParams]:
    base = {"max_tokens": max_tokens, "temperature": 1.0}
    return {
        "plain": SamplingParams(**base, ignore_eos=True),
        "logprobs=5": SamplingParams(**base, ignore_eos=True, logprobs=5),
        "penalties+bias": SamplingParams(
            **base,
            ignore_eos=True,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias=((32, 2.0), (101, -1.0)),
        ),
        "json_schema": SamplingParams(**base, grammar={"type": "json_schema", "schema": SCHEMA}),
    }


async def one(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    key = NamespaceKey(os.urandom(32))
    segments = [NamespaceSegment(start_token=0, namespace_id="bench", key=key)]
    async for out in engine.generate(rid, prompt, params, segments, use_cache=False):
        if out.error:
            raise RuntimeError(out.error)
        if out.finished:
            return out.usage or {}
    raise RuntimeError("no final output")


async def run(args: argparse.Namespace, progress: Progress) -> dict[str, dict[str, float]]:
    engine = Engine(WorkerConfig(model=args.model, max_model_len=1024, num_blocks=1024, threads=args.threads))
    engine.start()
    prompt = list(b"Write a short title and a few tags for an article about prefix caching: ")
    per_token: dict[str, list[float]] = {}
    throughput: dict[str, list[float]] = {}
    task = progress.add_task("rounds", total=args.rounds)
    try:
        for round_index in range(args.rounds):
            for name, params in modes(args.max_tokens).items():
                started = time.perf_counter()
                usages = await asyncio.gather(
                    *(
                        one(engine, f"{name}-{round_index}-{i}", prompt, replace(params, seed=i))
                        for i in range(args.batch)
                    )
                )
                elapsed = time.perf_counter() - started
                tokens = sum(u["completion_tokens"] for u in usages)
                throughput.setdefault(name, []).append(tokens / elapsed)
                for u in usages:
                    if u["completion_tokens"] > 1:
                        per_token.setdefault(name, []).append(u["decode_ms"] / (u["completion_tokens"] - 1))
            progress.advance(task)
    finally:
        engine.stop()
    return {
        name: {
            "ms_per_token": round(statistics.median(per_token[name]), 3),
            "tokens_per_s": round(statistics.median(throughput[name]), 1),
        }
        for name in per_token
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 64 tokens")
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.rounds, args.max_tokens = (3, 64) if args.quick else (7, 128)
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        results = asyncio.run(run(args, progress))
    plain = results["plain"]["ms_per_token"]
    table = Table(title=f"decode cost per feature ({args.model}, batch {args.batch}, {args.rounds} rounds)")
    for column in ("mode", "ms/token (median)", "× plain", "tokens/s (batch)"):
        table.add_column(column, justify="right")
    for name, row in results.items():
        table.add_row(
            name,
            f"{row['ms_per_token']:.3f}",
            f"{row['ms_per_token'] / plain:.2f}",
            f"{row['tokens_per_s']:.0f}",
        )
    Console().print(table)
    ratios = {name: round(row["ms_per_token"] / plain, 3) for name, row in results.items()}
    print(
        json.dumps({"model": args.model, "batch": args.batch, "results": results, "ratio_to_plain": ratios})
    )


if __name__ == "__main__":
    main()
