"""The scheduler side of KvLLM: when to compress, physical block accounting, freeing.

``CompressingScheduler`` extends vLLM's V1 ``Scheduler`` (selected with
``scheduler_cls="kvllm.vllm.scheduler.CompressingScheduler"``; it runs in the EngineCore
process). ``request.num_computed_tokens`` stays *logical*: it indexes input ids and
drives all token accounting. A per-request ``kvllm_dropped`` count is subtracted only
where slots are counted: block allocation (:class:`PhysicalKVCacheManager`) and the
worker's slot mapping and attention lengths.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvllm.config import CompressionConfig
from kvllm.methods import stream_seed
from kvllm.policy import Policy, Region, SeqState, build_policy
from kvllm.vllm import metrics
from kvllm.vllm.admission import Footprint, admissible, project
from kvllm.vllm.plan import Compaction, StepPlan
from kvllm.vllm.settings import ModelCheck, check_kv_cache, check_vllm_config, request_config

logger = logging.getLogger(__name__)
DROPPED = "kvllm_dropped"
CONFIG = "kvllm_config"
# Set on a preempted request: its recomputation compresses its generated tokens again.
RECOMPUTE = "kvllm_recompute"
# Set (to anything but "" or "0") to make a round that would break the shared-block
# invariant (:func:`unsafe_blocks`) raise instead of being skipped; the tests set it.
STRICT_ENV = "KVLLM_STRICT"


def block_pool_used(scheduler: Scheduler) -> int:
    """KV blocks in use; block 0 is vLLM's null block, never free."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def unsafe_blocks(blocks: list[Any], start: int, end: int, block_size: int) -> list[int]:
    """Indices of the blocks holding slots ``[start, end)`` that a round must not rewrite.

    A round may rewrite a slot only in a block that its request alone holds
    (``ref_cnt == 1``) and that carries no hash: a hashed block can be matched by any
    later request with the same prefix, and a shared one is read by another request now.
    """
    last = min(cdiv(end, block_size), len(blocks))
    return [i for i in range(start // block_size, last) if blocks[i].ref_cnt != 1 or blocks[i].block_hash is not None]


def _startable(request: Request) -> bool:
    """Whether vLLM's admission loop may start ``request`` now (it skips the others:
    grammars still compiling, remote KV still loading, stale output in flight)."""
    if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return False
    return not (getattr(request, "num_stale_output_tokens", 0) and not getattr(request, "drop_stale_output", True))


class PhysicalKVCacheManager(KVCacheManager):
    """Allocates for a request's physical slots and can free its trailing blocks."""

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any):
        dropped = getattr(request, DROPPED, 0)
        if not dropped:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        # The base class reads num_computed_tokens as the slots already held.
        request.num_computed_tokens -= dropped
        try:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens += dropped

    def get_computed_blocks(self, request: Request) -> tuple[Any, int, int]:
        """vLLM's prefix hit, capped at a compressing request's full prompt blocks.

        Only prompt blocks of compressing requests are cached, but a request with
        compression off caches its generated blocks too. A compressing request recomputed
        after preemption, with the same prompt and the same tokens, could match those; its
        catch-up rounds would then rewrite blocks another request can match, scoring keys
        whose queries were never computed. Past the prompt it computes its own.
        """
        blocks, hit, boundary = super().get_computed_blocks(request)
        if getattr(request, CONFIG, None) is None or hit <= request.num_prompt_tokens:
            return blocks, hit, boundary
        block_size = self.coordinator.single_type_managers[0].block_size
        keep = request.num_prompt_tokens // block_size
        capped = self.create_kv_cache_blocks(tuple(list(group[:keep]) for group in blocks.blocks))
        return capped, keep * block_size, boundary

    def held_blocks(self, request_id: str) -> int:
        """KV blocks the request holds (its first group's; all groups match here)."""
        return len(self.coordinator.single_type_managers[0].req_to_blocks.get(request_id, ()))

    def free_trailing_blocks(self, request_id: str, num_tokens: int) -> int:
        """Return the blocks past the first ``num_tokens`` slots to the pool."""
        freed = 0
        for manager in self.coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request_id)
            keep = cdiv(num_tokens, manager.block_size)
            if not blocks or len(blocks) <= keep:
                continue
            tail = blocks[keep:]
            del blocks[keep:]
            self.block_pool.free_blocks(reversed([b for b in tail if not b.is_null]))
            freed += len(tail)
        return freed


def _cap_caching(manager: KVCacheManager) -> None:
    """Make ``manager``'s coordinator cache a compressing request's prompt blocks only.

    vLLM hashes a full block by the logical tokens it was written for and registers it
    for prefix matching (the coordinator's ``cache_blocks``, from ``allocate_slots`` and
    the connector paths). A round rewrites every block from its region's start on, and a
    region never starts inside the prompt (docs/design.md, "Prefix caching"). Capping the
    cached tokens at the prompt's keeps every block a round may rewrite out of the cache
    from the start: it is never hashed, so it can never be matched, and nothing has to be
    evicted before a round. Requests with compression off cache as vLLM does.
    """
    base = type(manager.coordinator)

    def cache_blocks(self: Any, request: Request, num_computed_tokens: int) -> None:
        if getattr(request, CONFIG, None) is not None:
            num_computed_tokens = min(num_computed_tokens, request.num_prompt_tokens)
        base.cache_blocks(self, request, num_computed_tokens)

    # A direct subclass: with a mixin first, CPython refuses the __class__ swap (layout).
    manager.coordinator.__class__ = type(f"PromptOnly{base.__name__}", (base,), {"cache_blocks": cache_blocks})


@dataclass
class RequestCompression:
    """One request's compression state and statistics."""

    config: CompressionConfig | None
    policy: Policy | None
    state: SeqState
    tokens_dropped: int = 0
    blocks_freed: int = 0
    seconds: float = 0.0
    # Projected blocks from decode step ``profile_start`` on (kvllm/vllm/admission.py):
    # exact while the request decodes, so it is computed once.
    profile: np.ndarray | None = None
    profile_start: int = 0

    def stats(self) -> dict[str, Any]:
        return {
            "method": None if self.config is None else self.config.method,
            "retention": None if self.config is None else self.config.retention,
            "logical_length": self.state.logical_length,
            "physical_length": self.state.length,
            "compressions": self.state.rounds,
            "tokens_dropped": self.tokens_dropped,
            "blocks_freed": self.blocks_freed,
            "compress_seconds": self.seconds,
        }


@dataclass
class CompressionTotals:
    """Engine-wide counters (exported as metrics)."""

    rounds: int = 0
    # Rounds not run because they would have rewritten a shared or cached block, or that
    # failed (in planning, or in the worker's selection); their requests compress no more.
    rounds_refused: int = 0
    preemptions: int = 0
    tokens_dropped: int = 0
    blocks_freed: int = 0
    seconds: float = 0.0


class CompressingScheduler(Scheduler):
    """vLLM's scheduler plus periodic (or threshold) KV compression rounds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_config = check_vllm_config(self.vllm_config)
        self.kv_model_check = ModelCheck.of(self.vllm_config)
        if self.kv_config is not None:
            check_kv_cache(self.kv_cache_config)
        self.kv_cache_manager.__class__ = PhysicalKVCacheManager
        if self.kv_config is not None and self.kv_cache_manager.enable_caching:
            _cap_caching(self.kv_cache_manager)
        self.kv_query_bytes = 0
        if self.kv_config is not None:
            # The worker's query ring, outside the KV pool: layers x Hq x (W + b + P) x D.
            m, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
            self.kv_query_bytes = (
                m.get_num_layers(parallel)
                * m.get_num_attention_heads(parallel)
                * self.kv_config.query_buffer_len
                * m.get_head_size()
                * m.dtype.itemsize
            )
        self.kv_requests: dict[str, RequestCompression] = {}
        self.kv_totals = CompressionTotals()
        # Live metrics for the API process's /metrics (kvllm/vllm/metrics.py), after every step.
        directory = os.environ.get(metrics.ENV)
        self.kv_publisher = None
        if directory:
            self.kv_publisher = metrics.EnginePublisher(directory, self.vllm_config.parallel_config.data_parallel_rank)
            self._publish()

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        plan = self._plan() if self.kv_config is not None else None
        limit = self.max_num_active_reqs
        if plan is not None and self.kv_config.admission == "projected" and (self.waiting or self.kv_holding_waiting):
            # vLLM's admission loop stops at this cap; lowering it for one step is the
            # whole change, so vLLM still decides everything else (budgets, prefix, order).
            self.max_num_active_reqs = self._admission_cap(limit)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs = limit
        if plan is not None:
            for req_id in output.num_scheduled_tokens:
                # A recomputation's first chunk: the worker captures its queries too (not
                # for a request with compression off, which no round will read).
                request = self.requests[req_id]
                if getattr(request, RECOMPUTE, False) and self._config(request) is not None:
                    plan.dropped.setdefault(req_id, getattr(request, DROPPED, 0))
            # A request preempted in this very schedule() lost its blocks: nothing to compact.
            gone = output.preempted_req_ids or set()
            plan.compactions = [c for c in plan.compactions if c.req_id not in gone]
            for req_id in gone:
                plan.dropped.pop(req_id, None)
                plan.keep_blocks.pop(req_id, None)
            output.kvllm = plan
        return output

    def add_request(self, request: Request) -> None:
        if self.kv_config is not None:
            self._config(request)  # before any block is cached: _cap_caching reads it
        super().add_request(request)

    def _config(self, request: Request) -> CompressionConfig | None:
        # Cached on the request: admission asks for it every step while it waits.
        if not hasattr(request, CONFIG):
            try:
                params = request.sampling_params
                config = request_config(self.kv_config, params.extra_args if params is not None else None)
                if config is not None and config is not self.kv_config:
                    self.kv_model_check(config)
            except ValueError as err:  # refused in the frontend (kvllm/vllm/frontend.py); never fail the engine
                logger.warning("request %s: compression off: %s", request.request_id, err)
                config = None
            setattr(request, CONFIG, config)
        return getattr(request, CONFIG)

    def _admission_cap(self, limit: int) -> int:
        """The admission cap that admits only what fits (docs/design.md, "Admission")."""
        # vLLM counts paused streaming sessions against the cap too.
        held = len(self.running) + self.num_waiting_for_streaming_input
        room = limit - held
        if room <= 0:
            return limit
        # vLLM drains kv_holding_waiting first, then waiting, and skips (without counting)
        # requests it cannot start this step; the cap counts the others, so project those.
        queue = itertools.chain(self.kv_holding_waiting, self.waiting)
        candidates = [self._footprint(r) for r in itertools.islice(filter(_startable, queue), room)]
        if not candidates:
            return limit
        running = [self._footprint(r).blocks for r in self.running]
        pool = self.kv_cache_manager.block_pool
        return held + admissible(running, candidates, pool.num_gpu_blocks - 1)

    def _footprint(self, request: Request) -> Footprint:
        entry = self.kv_requests.get(request.request_id)
        if entry is None or request.num_computed_tokens < request.num_tokens - 1:
            # Not decoding yet, or a recomputation still catching up: projected as a request
            # yet to prefill its whole token list (conservative: the catch-up only drops
            # slots), and not cached, since its decode steps start only once it has caught up.
            return project(request, self._config(request), None, self.max_model_len, self.block_size)
        if entry.config is None or entry.policy is None:  # it never compresses (again): plain growth
            return project(request, None, entry.state.prompt_len, self.max_model_len, self.block_size)
        if entry.profile is None:
            f = project(request, entry.config, entry.state.prompt_len, self.max_model_len, self.block_size)
            entry.profile, entry.profile_start = f.blocks, entry.state.decode_steps
        return Footprint(entry.profile[entry.state.decode_steps - entry.profile_start :], True)

    def _tracked(self, request: Request) -> RequestCompression:
        entry = self.kv_requests.get(request.request_id)
        if entry is None:
            config = self._config(request)
            # The prompt is protected, whatever chunk boundaries or prefix hits brought the
            # request here: it is counted from the request, never inferred from what was
            # computed (a chunk that ends one token short of the prompt leaves a one-token
            # step that looks like decoding, and its round rewrote a cached prompt block).
            state = SeqState(prompt_len=request.num_prompt_tokens)
            entry = RequestCompression(config, None if config is None else build_policy(config), state)
            self.kv_requests[request.request_id] = entry
        return entry

    def _plan(self) -> StepPlan:
        plan = StepPlan()
        for request in self.running:
            recompute = getattr(request, RECOMPUTE, False)
            if not recompute and request.num_computed_tokens < request.num_prompt_tokens:
                continue  # a prompt's prefill, its last token's step included: nothing to compress yet
            prefilling = request.num_computed_tokens < request.num_tokens - 1
            entry = self._tracked(request)
            dropped = getattr(request, DROPPED, 0)
            if entry.policy is None:
                if dropped:  # it compressed before a refused round: its slots stay physical
                    plan.dropped[request.request_id] = dropped
                continue
            state = entry.state
            state.logical_length = request.num_computed_tokens
            state.length = request.num_computed_tokens - dropped
            try:
                region = entry.policy.catch_up(state) if prefilling else entry.policy.plan(state)
            except Exception as err:  # a failing round is contained to its request
                self._refuse(f"request {request.request_id}: planning a compression round failed: {err!r}")
                entry.policy, region = None, None
            if region is not None and not self._safe(request, region, state.length):
                # The same region would be planned again at every period: this request
                # compresses no more (its dropped slots stay dropped).
                entry.policy = None
                region = None
            if region is not None:
                seed = stream_seed(request.prompt_token_ids or (), state.rounds)
                plan.compactions.append(
                    Compaction(request.request_id, region, entry.config, state.length, dropped, seed)
                )
                entry.policy.commit(state, region)
                dropped += region.freed
                setattr(request, DROPPED, dropped)
                freed = self.kv_cache_manager.free_trailing_blocks(request.request_id, state.length)
                plan.keep_blocks[request.request_id] = cdiv(state.length, self.block_size)
                entry.tokens_dropped += region.freed
                entry.blocks_freed += freed
                self.kv_totals.rounds += 1
                self.kv_totals.tokens_dropped += region.freed
                self.kv_totals.blocks_freed += freed
            plan.dropped[request.request_id] = dropped
        return plan

    def _safe(self, request: Request, region: Region, length: int) -> bool:
        """Whether a round on ``region`` rewrites only blocks ``request`` alone holds, unhashed.

        A round reads ``[region.start, length)`` and rewrites ``[region.start, length -
        region.freed)``. The scheduler keeps that true by construction (a protected prompt,
        prompt-only caching, prompt-only prefix hits); this is the check that it stays so.
        A round that would break it is not run and its request compresses no more: it is
        counted (once per request) and logged once, and raises under ``KVLLM_STRICT``.
        """
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        blocks = manager.req_to_blocks.get(request.request_id, [])
        bad = unsafe_blocks(blocks, region.start, length - region.freed, self.block_size)
        if not bad:
            return True
        self._refuse(
            f"request {request.request_id}: a round on slots [{region.start}, {length}) would rewrite "
            f"shared or cached blocks {bad}; not run"
        )
        return False

    def _refuse(self, message: str) -> None:
        """Count a round not run (or failed) as refused, and log it; raise under ``KVLLM_STRICT``.

        Its request compresses no more: the caller turns its policy off. Each is logged,
        naming the request: a refusal is an invariant tripped or a method that failed,
        never routine.
        """
        if os.environ.get(STRICT_ENV, "") not in ("", "0"):
            raise AssertionError(message)
        logger.warning("%s; the request compresses no more (kvllm:rounds_refused counts these)", message)
        self.kv_totals.rounds_refused += 1

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> Any:
        failed: dict[str, str] = getattr(model_runner_output, "kvllm_failed", None) or {}
        for req_id, why in failed.items():
            # The worker kept the area's newest slots, so the blocks freed at planning
            # stay right; the request goes on, uncompressed from here.
            if (entry := self.kv_requests.get(req_id)) is not None:
                entry.policy = None
            self._refuse(f"request {req_id}: its compression round failed in the worker ({why}), newest slots kept")
        seconds: dict[str, float] = getattr(model_runner_output, "kvllm_seconds", None) or {}
        for req_id, s in seconds.items():
            self.kv_totals.seconds += s
            if req_id in self.kv_requests:
                self.kv_requests[req_id].seconds += s
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._publish()  # after the step's finished requests were freed
        return outputs

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> Any:
        # Aborts (a client went away) free blocks outside a step: publish now, or the
        # gauges would show them held until the next step, which may never come.
        finished = super().finish_requests(request_ids, finished_status)
        self._publish()
        return finished

    def kv_live(self) -> dict[str, float]:
        """This engine's live metrics (:data:`kvllm.vllm.metrics.FIELDS`)."""
        t = self.kv_totals
        logical = physical = saved = 0
        bs = self.block_size
        for request in self.running:
            n = request.num_computed_tokens
            kept = n - getattr(request, DROPPED, 0)
            logical += n
            physical += kept
            saved += cdiv(n, bs) - cdiv(kept, bs)
        return {
            "compression_rounds": t.rounds,
            "tokens_dropped": t.tokens_dropped,
            "blocks_freed": t.blocks_freed,
            "compress_seconds": t.seconds,
            "rounds_refused": t.rounds_refused,
            "preemptions": t.preemptions,
            "kv_logical_tokens": logical,
            "kv_physical_tokens": physical,
            "kv_blocks_saved": saved,
            "kv_blocks_used": block_pool_used(self),
        }

    def _publish(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.kv_live())

    def shutdown(self) -> None:
        super().shutdown()
        if self.kv_publisher is not None:
            self.kv_publisher.close()

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        # vLLM's last cap on a prefill chunk, in both its running and waiting loops: the
        # one place a chunk's length can be cut per request.
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        stop = self._recompute_stop(request)
        if stop is not None and num_computed_tokens < stop < num_computed_tokens + num_new_tokens:
            return stop - num_computed_tokens
        return num_new_tokens

    def _recompute_stop(self, request: Request) -> int | None:
        """Where a recomputing request's chunk must end for its next catch-up round."""
        if self.kv_config is None or not getattr(request, RECOMPUTE, False):
            return None
        entry = self.kv_requests.get(request.request_id)
        if entry is None:  # its first chunk: nothing compressed yet
            config = self._config(request)
            if config is None:
                return None
            return build_policy(config).recompute_stop(SeqState(prompt_len=request.num_prompt_tokens))
        return None if entry.policy is None else entry.policy.recompute_stop(entry.state)

    def _preempt_request(self, request: Request, timestamp: float, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, timestamp, *args, **kwargs)
        # Preemption recomputes from token 0 with a full cache: start compression afresh,
        # window by window over what it had generated.
        setattr(request, DROPPED, 0)
        setattr(request, RECOMPUTE, True)
        self.kv_requests.pop(request.request_id, None)
        self.kv_totals.preemptions += 1

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super()._connector_finished(request)
        if request.request_id not in self.kv_requests and request.num_computed_tokens:
            # It finished without a decode step of its own (max_tokens=1, or the last token
            # came from the prefill that recomputed it after preemption): no rounds, but
            # its statistics still say what it held and how it was configured.
            self._tracked(request)
        entry = self.kv_requests.pop(request.request_id, None)
        if entry is None:  # aborted before any of it was computed
            return delay, params
        # Lengths as of the last forward (the state was last synced when planning it).
        entry.state.logical_length = request.num_computed_tokens
        entry.state.length = request.num_computed_tokens - getattr(request, DROPPED, 0)
        stats = {**entry.stats(), "query_buffer_bytes": self.kv_query_bytes if entry.config else 0}
        # Per-request statistics reach RequestOutput.kv_transfer_params.
        return delay, {**(params or {}), "kvllm": stats}

    def kv_stats(self) -> dict[str, Any]:
        """Engine-wide compression counters."""
        t = self.kv_totals
        return {
            "rounds": t.rounds,
            "rounds_refused": t.rounds_refused,
            "preemptions": t.preemptions,
            "tokens_dropped": t.tokens_dropped,
            "blocks_freed": t.blocks_freed,
            "compress_seconds": t.seconds,
            "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
            "query_buffer_bytes_per_request": self.kv_query_bytes,
            "tracked_requests": len(self.kv_requests),
        }
