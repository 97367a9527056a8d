"""Synthetic multi-tenant prompt workloads, written in the Mooncake JSONL trace format.

A request's prompt is built the way chat applications build theirs, so its blocks form prefix chains:

    [system prompt: the tenant's own, or a public template] [RAG document?] [earlier turns] [new message]

- ``num_tenants`` tenants with Zipf-distributed traffic; each has its own system prompts and RAG
  documents, picked with Zipf popularity. A few public prompts (templates everyone uses) are shared
  across tenants: their blocks get the same ids whichever tenant sends them.
- Conversations are multi-turn sessions: turn ``k``'s prompt is turn ``k - 1``'s prompt plus its answer
  plus a new user message. Sessions start as a Poisson process; turns follow after a think time.
- Tool agents (``tool_result_blocks`` > 0) append a tool's output to the context after each answer:
  many short turns, each a strict extension of the last, a few seconds apart.
- Block ids are chained the way the worker hashes prefixes: a block's id is determined by its parent's
  id and its own content, so equal ids at the same position mean equal prefixes.

``plan_workload`` returns each request as a list of parts (which system prompt, document, turns: keys
and lengths), ``generate_workload`` turns the parts into chained block ids, and ``bench.chat_workload``
turns the same parts into chat messages. ``python -m bench.workloads --out FILE`` writes a trace; the
last line printed is one JSON object with its counts.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from collections.abc import Hashable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench.trace import TraceRequest, num_unique_blocks, write_trace


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """Shape of a synthetic workload. Every count is per workload unless it says per tenant."""

    num_tenants: int = 8
    num_requests: int = 4000
    seed: int = 0
    block_tokens: int = 512  # tokens per hash id (Mooncake traces use 512)
    session_rate_per_s: float = 2.0  # Poisson arrivals of new sessions
    tenant_zipf: float = 1.0  # skew of traffic across tenants
    system_prompts_per_tenant: int = 4
    system_prompt_blocks: tuple[int, int] = (2, 12)  # min, max blocks
    public_prompts: int = 3  # templates shared by every tenant
    public_prompt_share: float = 0.3  # fraction of sessions that use a public template
    public_prompt_blocks: tuple[int, int] = (4, 16)
    documents_per_tenant: int = 200
    document_blocks: tuple[int, int] = (8, 64)
    document_share: float = 0.6  # fraction of sessions that attach a RAG document
    popularity_zipf: float = 1.1  # skew of system prompt and document popularity within a tenant
    mean_turns: float = 3.0  # turns per session (geometric)
    mean_think_s: float = 40.0  # time between a session's turns (exponential)
    message_blocks: tuple[int, int] = (1, 4)  # new user message per turn
    answer_blocks: tuple[int, int] = (0, 3)  # assistant answer kept in the next turn's prompt
    tool_result_blocks: tuple[int, int] = (0, 0)  # tool output appended after each answer (agents)


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """One piece of a planned prompt: which content it holds and how long it is, not its text.

    ``key[0]`` is the kind: ``system`` (a tenant's own system prompt), ``public`` (a template every
    tenant may use), ``document``, ``message`` (a user turn), ``answer`` (an assistant turn) or
    ``tool`` (a tool's output in an agent loop).
    Equal keys mean equal content.
    """

    key: tuple[Hashable, ...]
    num_blocks: int  # length in units of ``WorkloadSpec.block_tokens`` (an answer may have 0)

    @property
    def kind(self) -> str:
        return str(self.key[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRequest:
    """One request of the workload as a list of parts, before it becomes block ids or text."""

    timestamp_ms: float
    tenant: int  # index; the trace names it ``t{tenant}``
    session_id: int
    parts: tuple[Part, ...]  # prompt order: system prompt, document?, earlier turns, new message
    input_length: int  # tokens, as written to the trace
    output_length: int

    @property
    def tenant_name(self) -> str:
        return f"t{self.tenant}"


class _ChainIds:
    """Block ids of a prefix tree: one id per (parent id, block content)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def extend(self, parent: int, contents: list[Hashable], out: list[int]) -> int:
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            out.append(parent)
        return parent


class _Zipf:
    """Draws ``0 … n-1`` with probability proportional to ``1 / (rank + 1) ** exponent``."""

    def __init__(self, n: int, exponent: float, rng: random.Random) -> None:
        self._rng = rng
        self._items = list(range(n))
        rng.shuffle(self._items)  # popularity rank is not the index
        self._cum_weights = list(itertools.accumulate(1.0 / (rank + 1) ** exponent for rank in range(n)))

    def draw(self) -> int:
        return self._rng.choices(self._items, cum_weights=self._cum_weights)[0]


@dataclass(slots=True)
class _Session:
    """One conversation: its fixed head and the turns so far."""

    tenant: int
    session_id: int
    head: list[Part]  # system prompt (or public template), then the document if any
    turns_left: int
    history: list[Part]  # earlier messages and answers


def _span(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def plan_workload(spec: WorkloadSpec) -> list[PlannedRequest]:
    """Requests of the workload in arrival order, as parts (``generate_workload`` turns them into ids)."""
    rng = random.Random(spec.seed)
    tenants = _Zipf(spec.num_tenants, spec.tenant_zipf, rng)
    system_picks = [
        _Zipf(spec.system_prompts_per_tenant, spec.popularity_zipf, rng) for _ in range(spec.num_tenants)
    ]
    document_picks = [
        _Zipf(spec.documents_per_tenant, spec.popularity_zipf, rng) for _ in range(spec.num_tenants)
    ]
    public_pick = _Zipf(max(spec.public_prompts, 1), spec.popularity_zipf, rng)
    lengths: dict[Hashable, int] = {}

    def part(key: tuple[Hashable, ...], bounds: tuple[int, int]) -> Part:
        if key not in lengths:
            lengths[key] = _span(rng, bounds)
        return Part(key=key, num_blocks=lengths[key])

    def new_session(session_id: int) -> _Session:
        tenant = tenants.draw()
        if spec.public_prompts and rng.random() < spec.public_prompt_share:
            head = [part(("public", public_pick.draw()), spec.public_prompt_blocks)]
        else:
            head = [part(("system", tenant, system_picks[tenant].draw()), spec.system_prompt_blocks)]
        if rng.random() < spec.document_share:
            head.append(part(("document", tenant, document_picks[tenant].draw()), spec.document_blocks))
        turns = 1
        while rng.random() > 1.0 / spec.mean_turns:
            turns += 1
        return _Session(tenant=tenant, session_id=session_id, head=head, turns_left=turns, history=[])

    planned: list[PlannedRequest] = []
    pending: list[tuple[float, int, _Session]] = []  # (next turn time, tie-break, session)
    next_session_s = 0.0
    num_sessions = 0
    while len(planned) < spec.num_requests:
        if not pending or next_session_s <= pending[0][0]:
            session = new_session(num_sessions)
            heapq.heappush(pending, (next_session_s, num_sessions, session))
            num_sessions += 1
            next_session_s += rng.expovariate(spec.session_rate_per_s)
            continue
        now_s, tie, session = heapq.heappop(pending)
        turn = len(planned)
        message = Part(key=("message", session.session_id, turn), num_blocks=_span(rng, spec.message_blocks))
        parts = (*session.head, *session.history, message)
        num_blocks = sum(p.num_blocks for p in parts)
        answer = Part(key=("answer", session.session_id, turn), num_blocks=_span(rng, spec.answer_blocks))
        tokens = spec.block_tokens
        planned.append(
            PlannedRequest(
                timestamp_ms=round(now_s * 1000.0, 3),
                tenant=session.tenant,
                session_id=session.session_id,
                parts=parts,
                input_length=num_blocks * tokens - rng.randrange(tokens),
                output_length=max(answer.num_blocks, 1) * tokens - rng.randrange(tokens),
            )
        )
        session.history += [message, answer]
        if spec.tool_result_blocks[1] > 0:  # a tool-agent loop: the call's result joins the context
            num_result_blocks = _span(rng, spec.tool_result_blocks)
            session.history.append(Part(key=("tool", session.session_id, turn), num_blocks=num_result_blocks))
        session.turns_left -= 1
        if session.turns_left > 0:
            heapq.heappush(pending, (now_s + rng.expovariate(1.0 / spec.mean_think_s), tie, session))
    return planned


def generate_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    """Requests of the workload in arrival order, with tenant names ``t0 … t{n-1}``."""
    chains = _ChainIds()
    requests: list[TraceRequest] = []
    for plan in plan_workload(spec):
        hash_ids: list[int] = []
        units = [(*p.key, i) for p in plan.parts for i in range(p.num_blocks)]
        chains.extend(-1, units, hash_ids)
        requests.append(
            TraceRequest(
                timestamp_ms=plan.timestamp_ms,
                hash_ids=tuple(hash_ids),
                tenant=plan.tenant_name,
                input_length=plan.input_length,
                output_length=plan.output_length,
            )
        )
    return requests


def _add_fields(parser: Any, spec: Any) -> None:
    """One flag on ``parser`` (a parser or argument group) per dataclass field of ``spec``, whose values
    are the defaults."""
    for field in fields(spec):
        default = getattr(spec, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, tuple):
            parser.add_argument(flag, type=int, nargs=2, default=default, metavar=("MIN", "MAX"))
        else:
            parser.add_argument(flag, type=type(default), default=default)


def _parse_args(argv: list[str] | None) -> tuple[WorkloadSpec, dict[str, Any] | None, str]:
    """The workload spec, the chat options (None without ``--chat``) and the output path."""
    from bench.chat_workload import ChatSpec  # imported here: chat_workload builds on this module

    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument(
        "--chat", action="store_true", help="write chat requests (messages, tools) instead of block ids"
    )
    _add_fields(parser, WorkloadSpec())
    _add_fields(parser.add_argument_group("chat requests (--chat)"), ChatSpec())
    args = vars(parser.parse_args(argv))
    out, chat = args.pop("out"), args.pop("chat")
    chat_options = {f.name: args.pop(f.name) for f in fields(ChatSpec)}
    spec = WorkloadSpec(**{name: tuple(v) if isinstance(v, list) else v for name, v in args.items()})
    return spec, chat_options if chat else None, out


def main(argv: list[str] | None = None) -> None:
    spec, chat_options, out = _parse_args(argv)
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # bench/out/ is not in a fresh checkout
    if chat_options is not None:
        from bench.chat_workload import ChatSpec, chat_workload

        chat_requests = chat_workload(spec, ChatSpec(**chat_options))
        with open(out, "w", encoding="utf-8") as lines:
            lines.writelines(request.to_json() + "\n" for request in chat_requests)
        print(f"wrote {len(chat_requests)} chat requests, {spec.num_tenants} tenants to {out}")
        summary = {"chat_requests": len(chat_requests)}
    else:
        requests = generate_workload(spec)
        write_trace(out, requests)
        num_blocks, num_unique = sum(len(r.hash_ids) for r in requests), num_unique_blocks(requests)
        print(
            f"wrote {len(requests)} requests, {num_blocks} blocks, {num_unique} unique, "
            f"{spec.num_tenants} tenants to {out}"
        )
        summary = {"requests": len(requests), "blocks": num_blocks, "unique_blocks": num_unique}
    print(json.dumps({"bench": "workloads", "out": str(out), **summary, "tenants": spec.num_tenants}))


if __name__ == "__main__":
    main()
