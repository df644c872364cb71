"""Where an engine step's time goes: wall-clock timers around vLLM's and KvLLM's step parts.

The timers wrap methods at class level, so they must be installed before the engine is
built and read from the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). On a CPU
every part runs synchronously, so a part's wall time is its cost. A part called inside
another of the same name (a subclass calling ``super()``) counts once, at the outermost.

:func:`split` turns the nested totals into exclusive parts that add up to the measured
wall time: attention (the kernel, KV-cache write included), the attention block's
projections, norms and rotary embedding, the MLP, the rest of the forward pass, the
logits, compression rounds, the runner's input preparation and sampling, the scheduler,
and what lies outside the engine core's step (output processing, detokenizing).
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# (module, class, method, part): the methods timed. Several classes may feed one part.
TARGETS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm.v1.engine.core", "EngineCore", "step", "step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "schedule"),
    ("kvllm.vllm.scheduler", "CompressingScheduler", "schedule", "schedule"),
    ("kvllm.vllm.scheduler", "CompressingScheduler", "update_from_output", "schedule"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "runner"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "runner"),
    ("kvllm.vllm.runner", "CompressingCPUModelRunner", "execute_model", "runner"),
    ("kvllm.vllm.runner", "CompressingCPUModelRunner", "sample_tokens", "runner"),
    ("kvllm.vllm.runner", "CompressingCPUModelRunner", "_compact", "rounds"),
    ("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM", "forward", "forward"),
    ("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM", "compute_logits", "logits"),
    ("vllm.model_executor.models.qwen3", "Qwen3Attention", "forward", "attention_block"),
    ("vllm.model_executor.layers.attention.attention", "Attention", "forward", "attention"),
    ("vllm.model_executor.models.qwen2", "Qwen2MLP", "forward", "mlp"),
)


@dataclass
class StepTimer:
    """Seconds per part, counted while armed (after start-up and warm-up)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    armed: bool = False
    _depth: dict[str, int] = field(default_factory=dict)

    def arm(self) -> None:
        """Start counting now; earlier calls (start-up, warm-up) are dropped."""
        self.seconds.clear()
        self.calls.clear()
        self.armed = True

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = self._depth.get(part, 0)
            if depth or not self.armed:
                self._depth[part] = depth + 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._depth[part] = depth
            self._depth[part] = 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
                self.calls[part] = self.calls.get(part, 0) + 1
                self._depth[part] = 0

        return timed


@contextmanager
def step_timer() -> Iterator[StepTimer]:
    """Install the timers for the block; build the engine inside it and call ``arm()``
    when the measured work starts."""
    timer = StepTimer()
    undo: list[tuple[type, str, Any]] = []
    try:
        for module, cls_name, method, part in TARGETS:
            cls = getattr(importlib.import_module(module), cls_name)
            if method not in vars(cls):
                raise RuntimeError(f"{module}.{cls_name}.{method} is gone: update kvllm.vllm.profile.TARGETS")
            undo.append((cls, method, vars(cls)[method]))
            setattr(cls, method, timer.wrap(part, vars(cls)[method]))
        yield timer
    finally:
        for cls, method, fn in reversed(undo):
            setattr(cls, method, fn)


def split(timer: StepTimer, wall: float) -> dict[str, float]:
    """Exclusive seconds per part; they sum to ``wall``, the measured work's wall time
    (the serving loop's, from ``arm()`` on)."""
    s = timer.seconds.get
    forward = s("forward", 0.0)
    block = s("attention_block", 0.0)
    attention = s("attention", 0.0)
    mlp = s("mlp", 0.0)
    rounds = s("rounds", 0.0)
    logits = s("logits", 0.0)
    runner = s("runner", 0.0)
    schedule = s("schedule", 0.0)
    step = s("step", 0.0)
    return {
        "attention": attention,
        "attention_projections": block - attention,
        "mlp": mlp,
        "forward_other": forward - block - mlp,
        "logits": logits,
        "rounds": rounds,
        "runner_other": runner - forward - logits - rounds,
        "schedule": schedule,
        "step_other": step - runner - schedule,
        "outside_step": wall - step,
    }
