"""The step timers: armed counting, nested calls of one part counted once, exclusive parts."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

import kvllm.vllm.profile as profile
from kvllm.vllm.profile import TARGETS, StepTimer, split, step_timer

CLOCK = SimpleNamespace(now=0.0)  # a fake perf_counter: work advances it by exactly its seconds


class Base:
    def work(self, seconds: float) -> str:
        CLOCK.now += seconds
        return "done"


class Child(Base):
    def work(self, seconds: float) -> str:
        return super().work(seconds)


def _install(timer: StepTimer) -> None:
    Base.work = timer.wrap("work", vars(Base)["work"])
    Child.work = timer.wrap("work", vars(Child)["work"])


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(profile, "time", SimpleNamespace(perf_counter=lambda: CLOCK.now))
    saved = vars(Base)["work"], vars(Child)["work"]
    t = StepTimer()
    _install(t)
    yield t
    Base.work, Child.work = saved


def test_nothing_counts_before_arm(timer: StepTimer) -> None:
    assert Child().work(0.0) == "done"
    assert timer.seconds == {}
    timer.arm()
    Child().work(0.0)
    assert timer.calls == {"work": 1}


def test_a_subclass_calling_super_counts_once(timer: StepTimer) -> None:
    timer.arm()
    Child().work(0.02)
    Base().work(0.01)
    assert timer.calls == {"work": 2}
    # Counted twice, the child's 0.02 s would make it 0.05 s.
    assert timer.seconds["work"] == pytest.approx(0.03)


def test_an_exception_still_counts_and_resets_depth(timer: StepTimer) -> None:
    timer.arm()
    with pytest.raises(TypeError):
        Child().work("not a number")
    Child().work(0.0)
    assert timer.calls == {"work": 2}


def test_arm_drops_earlier_counts(timer: StepTimer) -> None:
    timer.arm()
    Child().work(0.0)
    timer.arm()
    assert timer.seconds == {} and timer.calls == {}


def test_split_parts_add_up_to_wall() -> None:
    t = StepTimer()
    t.seconds = {
        "step": 9.0, "schedule": 1.0, "runner": 7.0, "forward": 5.0, "logits": 0.5, "rounds": 0.5,
        "attention_block": 3.0, "attention": 2.0, "mlp": 1.5,
    }  # fmt: skip
    parts = split(t, 10.0)
    assert sum(parts.values()) == pytest.approx(10.0)
    assert parts["attention_projections"] == pytest.approx(1.0)
    assert parts["forward_other"] == pytest.approx(0.5)
    assert parts["runner_other"] == pytest.approx(1.0)
    assert parts["step_other"] == pytest.approx(1.0)
    assert parts["outside_step"] == pytest.approx(1.0)


def test_step_timer_wraps_every_target_and_restores_it() -> None:
    def current(module: str, cls: str, method: str):
        return vars(getattr(importlib.import_module(module), cls))[method]

    before = {t[:3]: current(*t[:3]) for t in TARGETS}
    with step_timer():
        for key, fn in before.items():
            assert current(*key) is not fn and current(*key).__wrapped__ is fn
    assert all(current(*key) is fn for key, fn in before.items())
