"""Urgent embeddings during a background flood: the embedder before issue 12's fairness work vs now.

    python -m bench.embedding_before [--rounds 6]

Before (``BEFORE``, read from git history): one thread and a priority queue, so an urgent embedding
waited for the background one running when it arrived. Now: an urgent thread of its own, the background
thread at nice +10. Each round floods 64 distinct background heads, then embeds 16 urgent heads arriving
at random moments (0–8 ms apart), old and new alternating round by round. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

from bench.embedding import ROOT, ms, prompt_heads
from gateway.embedding import PromptEmbedder

BEFORE = "8a852b9"  # the last commit with the single priority thread


def load_before(tmp: Path):
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{BEFORE}:gateway/embedding.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp / "embedding_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("embedding_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def round_of(
    embedder, heads: list[str], tag: str, rng: random.Random, with_tenant: bool
) -> list[float]:
    await embedder.warm_up()
    tenant = (lambda name: {"tenant": name}) if with_tenant else (lambda name: {})
    flood = [
        asyncio.create_task(embedder.embed(f"{heads[i]} flood {tag}", urgent=False, **tenant("flood")))
        for i in range(64)
    ]
    await asyncio.sleep(0.01)
    urgent = []
    for i in range(16):
        await asyncio.sleep(rng.uniform(0, 0.008))
        started = time.perf_counter()
        await embedder.embed(f"{heads[100 + i]} urgent {tag}", urgent=True, **tenant("quiet"))
        urgent.append(time.perf_counter() - started)
    await asyncio.gather(*flood, return_exceptions=True)
    embedder.close()
    return urgent


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    heads, _ = prompt_heads(200)
    rng = random.Random(5)
    with tempfile.TemporaryDirectory(prefix="bench-embedding-before-") as tmp:
        before = load_before(Path(tmp))
        cache = Path(tmp) / "embeddings"
        times: dict[str, list[float]] = {"before": [], "now": []}
        for r in range(args.rounds):
            old = before.PromptEmbedder(cache_dir=cache)
            times["before"] += await round_of(old, heads, f"b{r}", rng, with_tenant=False)
            times["now"] += await round_of(
                PromptEmbedder(cache_dir=cache), heads, f"n{r}", rng, with_tenant=True
            )
    result = {name: {"p50_ms": ms(v, 50), "p99_ms": ms(v, 99), "n": len(v)} for name, v in times.items()}
    for name, row in result.items():
        print(f"urgent embedding during a 64-head background flood, {name}: {row}")
    print(json.dumps({"results": result}))


if __name__ == "__main__":
    asyncio.run(main())
