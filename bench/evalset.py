"""The evaluation set of the eviction policies: several trace families, some kept out of tuning.

A default eviction policy must not be judged on the one trace it was designed on. The set holds the
shared Mooncake synthetic trace and generated workloads (``bench.workloads``) of three families, each
at two or more parameter settings:

- ``chat-*``: multi-turn conversations (long sessions, little RAG), the family on which the old default
  lost to LRU at 10-20 % of the unique blocks;
- ``rag-*`` and ``mixed-*``: document reuse and the generator's multi-tenant mix;
- ``agent-*``: tool agents, many short turns that each append a tool's output.

Traces whose ``held_out`` is true were never replayed while the default's constants were chosen: they
are the check that the default generalizes (``docs/eviction.md``). ``compact`` sizes keep the guarantee
test (``tests/bench/test_eviction_guarantee.py``) under a minute; ``python -m bench.evalset`` replays
the full-size set and prints one table per trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench.trace import TraceRequest, load_trace
from bench.workloads import WorkloadSpec, generate_workload

MOONCAKE_SYNTHETIC = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
# A ~180 kB slice of Mooncake's 2024 arXiv trace (not the FAST25 conversation trace): tests/data/README.md
MOONCAKE_ARXIV = MOONCAKE_SYNTHETIC.with_name("mooncake_arxiv_slice.jsonl")
COMPACT_BLOCKS = 40_000  # block accesses per trace in the CI guarantee test (a prefix of each trace)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalTrace:
    """One trace of the evaluation set."""

    name: str
    family: str  # mooncake, chat, rag, mixed, agent
    held_out: bool  # never replayed while tuning the default
    fresh: bool = False  # held out of every tuning round so far: replayed once, after the default was fixed
    spec: WorkloadSpec | None  # None: a file (``path``)
    path: Path | None = None

    def load(self, *, compact: bool = False) -> list[TraceRequest]:
        """The requests; ``compact``: only the first requests, up to ``COMPACT_BLOCKS`` block accesses."""
        if self.spec is None:
            assert self.path is not None
            requests = load_trace(self.path)
        else:
            requests = generate_workload(self.spec)
        if not compact:
            return requests
        num_blocks = 0
        for index, request in enumerate(requests):
            num_blocks += len(request.hash_ids)
            if num_blocks > COMPACT_BLOCKS:
                return requests[:index]
        return requests


def _chat(seed: int, **changes: object) -> WorkloadSpec:
    base = WorkloadSpec(
        seed=seed,
        num_requests=3000,
        mean_turns=8.0,
        mean_think_s=60.0,
        document_share=0.15,
        session_rate_per_s=0.5,
        answer_blocks=(1, 4),
    )
    return replace(base, **changes)


def _agent(seed: int, **changes: object) -> WorkloadSpec:
    base = WorkloadSpec(
        seed=seed,
        num_requests=3000,
        mean_turns=12.0,
        mean_think_s=4.0,
        document_share=0.1,
        public_prompt_share=0.6,
        public_prompt_blocks=(8, 24),
        session_rate_per_s=0.3,
        message_blocks=(1, 2),
        answer_blocks=(0, 1),
        tool_result_blocks=(1, 6),
    )
    return replace(base, **changes)


def evaluation_set() -> list[EvalTrace]:
    """Every trace of the set, tuning traces first."""
    return [
        EvalTrace(
            name="mooncake-synthetic", family="mooncake", held_out=False, spec=None, path=MOONCAKE_SYNTHETIC
        ),
        EvalTrace(name="mixed-default", family="mixed", held_out=False, spec=WorkloadSpec(num_requests=3000)),
        EvalTrace(
            name="rag-docs",
            family="rag",
            held_out=False,
            spec=WorkloadSpec(
                seed=3, num_requests=3000, document_share=0.9, mean_turns=1.5, documents_per_tenant=400
            ),
        ),
        EvalTrace(name="chat-long", family="chat", held_out=False, spec=_chat(11)),
        EvalTrace(name="agent-tools", family="agent", held_out=False, spec=_agent(21)),
        # Held out: other seeds and other parameter settings of every generated family.
        EvalTrace(
            name="chat-slow",
            family="chat",
            held_out=True,
            spec=_chat(12, mean_turns=12.0, mean_think_s=180.0, num_tenants=16, session_rate_per_s=1.0),
        ),
        EvalTrace(
            name="chat-busy",
            family="chat",
            held_out=True,
            spec=_chat(13, mean_turns=5.0, mean_think_s=20.0, session_rate_per_s=2.0, popularity_zipf=0.8),
        ),
        EvalTrace(
            name="agent-long",
            family="agent",
            held_out=True,
            spec=_agent(22, mean_turns=20.0, tool_result_blocks=(2, 12), public_prompts=6),
        ),
        EvalTrace(
            name="mixed-skewed",
            family="mixed",
            held_out=True,
            spec=WorkloadSpec(
                seed=31, num_requests=3000, tenant_zipf=1.4, popularity_zipf=1.3, num_tenants=12
            ),
        ),
        # Held out in the second round (issue 14, evict14): settings written down before any tuning of
        # the new default and replayed once, at the end. The four held-out traces above were published
        # in the first round and are no longer unseen.
        EvalTrace(
            name="chat-wide",
            family="chat",
            held_out=True,
            fresh=True,
            spec=_chat(
                14,
                mean_turns=6.0,
                mean_think_s=90.0,
                num_tenants=24,
                session_rate_per_s=0.8,
                document_share=0.3,
                popularity_zipf=1.0,
            ),
        ),
        EvalTrace(
            name="agent-bursty",
            family="agent",
            held_out=True,
            fresh=True,
            spec=_agent(
                23,
                mean_turns=16.0,
                mean_think_s=8.0,
                tool_result_blocks=(1, 10),
                public_prompt_share=0.4,
                session_rate_per_s=0.6,
            ),
        ),
        EvalTrace(
            name="mooncake-arxiv",
            family="mooncake",
            held_out=True,
            fresh=True,
            spec=None,
            path=MOONCAKE_ARXIV,
        ),
    ]


TraceFilter = Callable[[EvalTrace], bool]


def main(argv: list[str] | None = None) -> None:
    """Replay the full-size set: one table per trace, then one JSON line."""
    import argparse
    import json

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from bench.hitrate import simulate_one
    from bench.trace import num_unique_blocks

    parser = argparse.ArgumentParser(prog="python -m bench.evalset", description=main.__doc__)
    parser.add_argument("--policy", default="lru,arc,s3fifo,prefix,default", help="comma-separated")
    parser.add_argument("--trace", action="append", help="trace names (default: all)")
    parser.add_argument("--compact", action="store_true", help="the CI test's compact prefixes")
    args = parser.parse_args(argv)
    policies = [p for p in args.policy.split(",") if p]
    fractions = (0.01, 0.05, 0.1, 0.2)
    traces = [t for t in evaluation_set() if not args.trace or t.name in args.trace]
    out, results = Console(width=160), []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("replaying", total=len(traces) * len(fractions) * len(policies))
        for trace in traces:
            requests = trace.load(compact=args.compact)
            num_unique = num_unique_blocks(requests)
            rows: dict[str, list[float]] = {}
            for policy in policies:
                for fraction in fractions:
                    progress.update(task, description=f"{trace.name} {policy} {fraction:.0%}")
                    capacity = max(1, int(fraction * num_unique))
                    ratio = simulate_one(requests, policy, capacity).prefix_hit_ratio
                    rows.setdefault(policy, []).append(ratio)
                    results.append(
                        {
                            "trace": trace.name,
                            "held_out": trace.held_out,
                            "policy": policy,
                            "capacity": fraction,
                            "prefix_hit_ratio": round(ratio, 4),
                        }
                    )
                    progress.advance(task)
            table = Table(
                title=f"{trace.name} ({trace.family}{', held out' if trace.held_out else ''}; "
                f"{len(requests)} requests, {num_unique} unique blocks): prefix-usable hit ratio"
            )
            for column in ("policy", *(f"{f:.0%}" for f in fractions)):
                table.add_column(column, justify="right")
            for policy, ratios in rows.items():
                table.add_row(policy, *(f"{r:.4f}" for r in ratios))
            if "default" in rows and "lru" in rows and "arc" in rows:
                margins = [
                    d - max(a, b) for d, a, b in zip(rows["default"], rows["lru"], rows["arc"], strict=True)
                ]
                table.add_row("default − max(lru, arc)", *(f"{m:+.4f}" for m in margins))
            out.print(table)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
