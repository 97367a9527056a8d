"""Copies from host tiers into the device pool that overlap with the engine's other work.

With a GPU the copy runs on a separate CUDA stream from pinned memory and the step waits on its event;
on the CPU a copy thread does it. Either way the engine thread only polls ``done()``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def contiguous_runs(sources: list[int], targets: list[int]) -> list[tuple[int, int, int]]:
    """Pair lists as (source start, target start, length) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(sources, targets, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class Transfer:
    """One batch of block copies in flight."""

    def __init__(
        self,
        num_bytes: int,
        future: Future | None = None,
        event: torch.cuda.Event | None = None,
        keepalive: torch.Tensor | None = None,
    ) -> None:
        self.num_bytes = num_bytes
        self._keepalive = keepalive  # pinned staging memory must outlive the asynchronous copy
        self.started_s = time.perf_counter()
        self.finished_s: float | None = None
        self._future = future
        self._event = event

    def done(self) -> bool:
        finished = (
            self._future.done() if self._future is not None else bool(self._event and self._event.query())
        )
        if finished and self.finished_s is None:
            if self._future is not None:
                self._future.result()  # re-raise a failed copy
            self.finished_s = time.perf_counter()
        return finished

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()
        self.done()

    @property
    def seconds(self) -> float:
        return (self.finished_s or time.perf_counter()) - self.started_s


class Copier:
    """Copies host blocks into ``kv_cache`` asynchronously."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.cuda = kv_cache.is_cuda
        self._stream = torch.cuda.Stream(device=kv_cache.device) if self.cuda else None
        self._pool = None if self.cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")

    def copy_in(self, source: torch.Tensor, slots: list[int], block_ids: list[int]) -> Transfer:
        """Copy ``source[slots]`` (host) into ``kv_cache[block_ids]`` (device), in contiguous runs."""
        num_bytes = len(slots) * source[0].numel() * source.element_size()
        runs = contiguous_runs(slots, block_ids)
        if self._stream is not None:
            # The target blocks may still be read or written by kernels queued on the compute stream
            # for their previous owner: the copy must start after them.
            self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            with torch.cuda.stream(self._stream):
                for src, dst, n in runs:
                    self.kv_cache[dst : dst + n].copy_(source[src : src + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return Transfer(num_bytes, event=event, keepalive=source)
        assert self._pool is not None
        return Transfer(num_bytes, future=self._pool.submit(self._copy, source, runs))

    def _copy(self, source: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
        for src, dst, n in runs:
            self.kv_cache[dst : dst + n].copy_(source[src : src + n])

    def copy_out(self, block_id: int) -> torch.Tensor:
        """A CPU copy of one device block (synchronous: the block is reused right after)."""
        return self.kv_cache[block_id].to("cpu", copy=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
