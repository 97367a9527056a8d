"""What passes between the event loop and the engine thread: outputs, handles, command failures."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from worker.sequence import Sequence


class RequestError(ValueError):
    """A request the engine cannot serve as given (maps to HTTP 400)."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str = ""  # new text since the previous output
    token_ids: list[int] = field(default_factory=list)  # new tokens since the previous output
    finished: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # set on the final output
    error: str | None = None  # set when the engine failed the request
    logprobs: list[dict[str, Any]] | None = None  # TokenLogprob.to_json of the new tokens, when asked


@dataclass(slots=True)
class Handle:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput]
    outbox: list[tuple[Handle, RequestOutput]]  # the engine's per-step batch, shared by every handle

    def push(self, output: RequestOutput) -> None:
        """Queue an output; ``Engine._flush_outputs`` hands a step's outputs over in one wake-up."""
        self.outbox.append((self, output))


def deliver(batch: list[tuple[Handle, RequestOutput]]) -> None:
    for handle, output in batch:
        handle.outputs.put_nowait(output)


class CommandFailed(RuntimeError):
    """An engine command raised; the engine kept running."""


def set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def request_id_of(arg: Any) -> str:
    return arg if isinstance(arg, str) else getattr(arg, "request_id", "?")


def step_seqs(step: Any) -> list[Sequence]:
    return list(step.decodes) + [chunk.seq for chunk in step.prefills]
