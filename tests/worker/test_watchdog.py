"""The engine watchdog with an injected clock: stuck only with work pending and no progress."""

from worker.watchdog import StepWatchdog


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_idle_engine_is_never_stuck():
    clock = Clock()
    dog = StepWatchdog(stall_timeout_s=5.0, clock=clock)
    clock.now_s += 3600
    assert dog.problem() is None


def test_work_without_progress_is_reported_after_the_timeout():
    clock = Clock()
    dog = StepWatchdog(stall_timeout_s=5.0, clock=clock)
    dog.work_arrived()  # a command queued while the engine thread waited
    clock.now_s += 4.9
    assert dog.problem() is None
    clock.now_s += 0.2
    assert "no progress for 5.1 s" in (dog.problem() or "")
    dog.progress()  # the command completed
    assert dog.problem() is None
    clock.now_s += 6
    assert dog.problem() is not None  # a step that never returns
    dog.idle()
    assert dog.problem() is None


def test_more_work_does_not_reset_the_clock_of_a_stuck_engine():
    clock = Clock()
    dog = StepWatchdog(stall_timeout_s=5.0, clock=clock)
    dog.progress()
    clock.now_s += 4
    dog.work_arrived()
    clock.now_s += 2
    assert dog.problem() is not None
