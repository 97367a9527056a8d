"""Admission in the scheduler, driven step by step without a model: no deadlock, no head-of-line block."""

from policies.hashing import NamespaceKey, NamespaceSegment
from worker.block_manager import BlockManager
from worker.scheduler import Scheduler
from worker.sequence import SamplingParams, Sequence, Status, Timings

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def seq(rid: str, prompt: list[int], ns: str = "t", *, max_tokens: int = 4, reserved: int = 0) -> Sequence:
    segment = NamespaceSegment(
        start_token=0,
        namespace_id=ns,
        key=NamespaceKey(ns.encode().ljust(16, b"k")),
        reserved_blocks=reserved,
    )
    return Sequence(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        segments=(segment,),
        use_cache=True,
        detokenizer=None,  # type: ignore[arg-type]  # the scheduler never detokenizes
        timings=Timings(arrival_s=0.0),
    )


def make(num_blocks: int, max_num_batched_tokens: int, clock: Clock | None = None, **kw) -> Scheduler:
    bm = BlockManager(num_blocks, BS, eviction_policy="lru")
    return Scheduler(
        bm,
        model_fingerprint=b"f" * 32,
        max_num_batched_tokens=max_num_batched_tokens,
        clock=clock or Clock(),
        **kw,
    )


def step(sched: Scheduler) -> list[Sequence]:
    """One engine step as the engine does it, with token 7 as every model output; returns finished."""
    out = sched.schedule()
    sampled = list(out.decodes)
    for s in out.decodes:
        sched.advance(s, 1)
    for chunk in out.prefills:
        sched.advance(chunk.seq, chunk.length)
        if chunk.completes_prefill:
            sampled.append(chunk.seq)
    done = []
    for s in sampled:
        s.output_token_ids.append(7)
        if len(s.output_token_ids) >= s.sampling.max_tokens:
            sched.finish(s, "length")
            done.append(s)
    return done


def run_until_done(sched: Scheduler, seqs: list[Sequence], max_steps: int = 500) -> int:
    for n in range(max_steps):
        if all(s.is_finished for s in seqs):
            return n
        step(sched)
    raise AssertionError(f"not finished after {max_steps} steps: {[s.status for s in seqs]}")


def test_shared_prefix_admitted_together_then_a_large_request_neither_leaks_nor_hangs():
    # The repro: 128 blocks, 4096-token steps, A and B share a 40-block prefix, then C.
    sched = make(128, 4096)
    bm = sched.block_manager
    prefix = [(i * 31) % 251 for i in range(40 * BS)]
    a = seq("A", prefix + [1] * 8, max_tokens=12)
    b = seq("B", prefix + [2] * 8, max_tokens=40)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.status is b.status is Status.DECODING  # both prefilled the prefix in one step
    while not a.is_finished:
        step(sched)
    # B's block 40 is now published as a child of A's last prefix block: A's prefix is pinned by B.
    c = seq("C", [(i * 7) % 251 for i in range(70 * BS)], max_tokens=4)
    sched.add(c)
    run_until_done(sched, [b, c])
    assert not sched.running and not sched.waiting
    assert bm.num_blocks - bm.num_free_blocks - bm.num_evictable_blocks == 0  # nothing leaked
    assert bm.num_available_blocks() == bm.num_blocks


def test_a_request_that_cannot_fit_now_does_not_block_the_ones_behind_it():
    sched = make(64, 512, max_wait_s=5.0)
    bm = sched.block_manager
    # A dedicated tenant's cached blocks, reserved: 24 of the 64 blocks are protected from others.
    dedicated = seq("D", [(i * 3) % 251 for i in range(24 * BS + 1)], "dedicated", max_tokens=1, reserved=24)
    bm.set_reservation("dedicated", 24)
    sched.add(dedicated)
    run_until_done(sched, [dedicated])
    assert bm.num_available_blocks("other") == 40
    runner = seq("runner", [4] * (2 * BS), "other", max_tokens=30)
    sched.add(runner)
    step(sched)
    big = seq("big", [(i * 5) % 251 for i in range(40 * BS)], "other")  # needs 41 of the 40 not reserved
    small = [seq(f"s{i}", [i + 1] * (2 * BS), "other") for i in range(3)]
    for s in [big, *small]:
        sched.add(s)
    run_until_done(sched, small)  # on main: schedule() stopped at `big` and nothing behind it ran
    assert big.status is Status.WAITING and not runner.is_finished
    # Once nothing else runs, the reservation yields: it can never make the pool unusable for others.
    run_until_done(sched, [runner, big])
    assert bm.num_available_blocks(ignore_reservations=True) == bm.num_blocks


def test_an_aged_request_is_not_overtaken_forever():
    clock = Clock()
    sched = make(48, 512, clock, max_wait_s=5.0)
    long_runner = seq("long", [9] * (20 * BS), max_tokens=30)
    sched.add(long_runner)
    step(sched)
    big = seq("big", [(i * 5) % 251 for i in range(40 * BS)])
    sched.add(big)
    clock.now_s = 6.0  # aged: later small requests must wait behind it instead of overtaking it
    small = seq("small", [3] * BS)
    sched.add(small)
    step(sched)
    assert small.status is Status.WAITING
    run_until_done(sched, [long_runner, big, small])
    assert big.timings.admitted_s is not None and small.timings.admitted_s is not None
    assert big.timings.finished_s <= small.timings.finished_s


def test_a_request_larger_than_the_pool_is_rejected_alone():
    sched = make(8, 512)
    too_big = seq("huge", [1] * (9 * BS))
    fine = seq("fine", [2] * BS)
    sched.add(too_big)
    sched.add(fine)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.rejected] == ["huge"]
    assert [c.seq.request_id for c in out.prefills] == ["fine"]
