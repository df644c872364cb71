"""The worker side of KvLLM: physical slots, query capture, and compaction.

``CompressingCPUModelRunner`` extends vLLM's ``CPUModelRunner`` (the plugin swaps it in inside
the worker process). Without a ``kvllm`` engine config it behaves exactly like its base.
With one, each step it:

1. applies the scheduler's compactions *before* vLLM's own ``_update_states``, because
   the blocks the scheduler freed may be handed to another request in this very step;
2. truncates the block tables of requests whose trailing blocks were freed;
3. in ``_prepare_inputs``, makes the slot mapping (vLLM computes it from physical
   positions, ``logical - dropped``, see :class:`PhysicalBlockTable`) and then
   ``seq_lens`` physical, while positions, and so RoPE, stay logical;
4. publishes the decode rows whose queries the attention backend records.

Under tensor parallelism every rank runs this runner on its own slice of heads (Hq/tp
query heads, Hkv/tp KV heads, their KV cache and their query ring), with the same plan.
A round gathers its window's queries and keys from all ranks, so that every rank selects
on all heads, exactly as a single rank would, and keeps its own heads' rows: per-head
methods give the same answer either way, but ``random`` draws per (layer, head) from one
stream and ``chunkkv`` ranks chunks by a layer-wide score, which a rank's slice alone
would get wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
)
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.worker.block_table import MultiGroupBlockTable
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from kvllm.methods import Selection, Window, build
from kvllm.methods.lazy import lazy_select
from kvllm.methods.rope import Rope
from kvllm.vllm import paged
from kvllm.vllm.capture import LAYER_ATTR, QueryRing, StepCapture
from kvllm.vllm.plan import Compaction, StepPlan
from kvllm.vllm.settings import check_kv_sharing, engine_config

logger = logging.getLogger(__name__)


class PhysicalBlockTable(MultiGroupBlockTable):
    """vLLM's block tables, computing the slot mapping from physical positions.

    vLLM's ``_prepare_inputs`` computes the slot mapping from the logical positions it
    also feeds RoPE. While the runner sets ``kv_offsets`` (per scheduled token, its
    request's dropped slots), that one computation gets ``logical - dropped`` instead:
    the mapping vLLM's own kernel returns for the physical positions, computed once
    instead of logically and then again physically (a launch costs tens of microseconds
    of Python in vLLM's kernel launcher, whose argument binding alone is ~10-20 us here).
    """

    kv_offsets: torch.Tensor | None = None

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        if self.kv_offsets is not None:
            positions = positions - self.kv_offsets
        super().compute_slot_mapping(num_reqs, query_start_loc, positions)


class CompressingCPUModelRunner(CPUModelRunner):
    """``CPUModelRunner`` with KV compaction and logical/physical lengths."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.kv_config = engine_config(vllm_config.additional_config)
        self.kv_dropped: dict[str, int] = {}
        self.kv_ring: QueryRing | None = None
        self.kv_capture = StepCapture()
        self.kv_seconds: dict[str, float] = {}
        self.kv_layers: list[Any] = []
        self.kv_tp_size, self.kv_tp_rank = 1, 0
        self.kv_rope: Rope | None = None
        # Lazy retention: each request's newest candidates' stage-one scores, for its next round.
        self.kv_carry: dict[str, torch.Tensor] = {}
        # Requests whose round failed this step, and why: for the scheduler (sample_tokens).
        self.kv_failed: dict[str, str] = {}

    # -- setup ---------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self.kv_config is not None:  # refused at start-up, not at the first round
            check_kv_sharing(get_layers_from_vllm_config(self.vllm_config, Attention).values())

    def _kv_setup(self) -> None:
        """Ring buffers and layer handles, once the model and its caches exist."""
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        self.kv_layers = [layers[name] for name in sorted(layers, key=extract_layer_index)]
        bad = {layer.isa for layer in self.kv_layers} - set(paged.READABLE_ISAS)
        if bad:
            raise ValueError(
                f"KV compression reads the paged cache, which needs attention ISA in {paged.READABLE_ISAS}; "
                f"this model/CPU uses {sorted(bad)}"
            )
        first = self.kv_layers[0]
        self.kv_ring = QueryRing.allocate(
            layers=len(self.kv_layers),
            slots=self.scheduler_config.max_num_seqs,
            ring=self.kv_config.query_buffer_len,
            heads=first.num_heads,
            head_dim=first.head_size,
            dtype=self.model_config.dtype,
        )
        self.kv_capture.layer_of = {layer.layer_name: i for i, layer in enumerate(self.kv_layers)}
        for layer in self.kv_layers:
            setattr(layer, LAYER_ATTR, self.kv_capture)
        self.kv_tp_size = get_tensor_model_parallel_world_size()
        self.kv_tp_rank = get_tensor_model_parallel_rank()
        self.kv_rope = _rope_of(self.model)

    # -- per step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        plan: StepPlan | None = getattr(scheduler_output, "kvllm", None)
        if self.kv_config is not None and plan is not None:
            if self.kv_ring is None:
                self._kv_setup()
            self._kv_before_step(scheduler_output, plan)
        return super().execute_model(scheduler_output, intermediate_tensors)

    def _kv_before_step(self, scheduler_output: Any, plan: StepPlan) -> None:
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        for req_id in gone:
            self.kv_ring.release(req_id)
            self.kv_dropped.pop(req_id, None)
            self.kv_carry.pop(req_id, None)
        if plan.compactions:
            self._compact(plan.compactions)
        for req_id, keep in plan.keep_blocks.items():
            self._truncate_blocks(req_id, keep)
        self.kv_dropped = dict(plan.dropped)

    def _truncate_blocks(self, req_id: str, keep: int) -> None:
        state = self.requests.get(req_id)
        if state is None:
            return
        for ids in state.block_ids:
            del ids[keep:]
        row = self.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            for table in self.input_batch.block_table.block_tables:
                n = table.num_blocks_per_row[row]
                table.block_table.np[row, keep:n] = 0
                table.num_blocks_per_row[row] = min(n, keep)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        self.kv_capture.clear()  # capture state is per step
        if self.kv_config is None or self.kv_ring is None:
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        n_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:n_reqs]
        # One pass over the batch (its order is final: _update_states has run): each row's
        # dropped slots, -1 for a request that does not compress. The rest is numpy.
        dropped = np.fromiter((self.kv_dropped.get(r, -1) for r in req_ids), dtype=np.int64, count=n_reqs)
        compressible = dropped >= 0
        np.maximum(dropped, 0, out=dropped)
        shifted = bool(dropped.any())
        tables = self.input_batch.block_table
        if shifted:
            if not isinstance(tables, PhysicalBlockTable):
                tables.__class__ = PhysicalBlockTable
            # vLLM's req_indices is np.repeat(arange(n_reqs), num_scheduled_tokens): this is
            # dropped[req_indices], each token's request's offset.
            tables.kv_offsets = torch.from_numpy(np.repeat(dropped, num_scheduled_tokens[:n_reqs]))
        try:
            out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        finally:
            if shifted:
                tables.kv_offsets = None
        if shifted:
            # A CPU tensor: subtract through its numpy view (one op, not three torch ones).
            seq_lens = self.seq_lens.numpy()
            seq_lens[:n_reqs] -= dropped.astype(seq_lens.dtype)
        self._publish_capture(req_ids, compressible)
        return out

    def _publish_capture(self, req_ids: list[str], compressible: np.ndarray) -> None:
        """Rows of compressible requests, and where their queries go: a decode token, or
        the last R tokens of a recomputation's chunk (the ring keeps R; an earlier one
        would be overwritten in the same copy, whose order is undefined)."""
        qsl = self.query_start_loc.np[: len(req_ids) + 1]
        reqs = np.flatnonzero(compressible)
        if len(reqs):
            ring = self.kv_ring
            lengths = (qsl[reqs + 1] - qsl[reqs]).astype(np.int64)
            take = np.minimum(lengths, ring.ring)
            # Ring slots in batch order, as before: a request gets its slot at its first captured row.
            slots = np.fromiter((ring.slot(req_ids[i]) for i in reqs), dtype=np.int64, count=len(reqs))
            # Token j of request i's taken rows is its row's token lengths[i] - take[i] + j.
            ends = np.cumsum(take)
            within = np.arange(ends[-1]) - np.repeat(ends - take, take) + np.repeat(lengths - take, take)
            positions = np.repeat(self.input_batch.num_computed_tokens_cpu[reqs], take) + within
            self.kv_capture.publish(ring, np.repeat(slots, take), positions, np.repeat(qsl[reqs], take) + within)

    # -- compaction ----------------------------------------------------------------
    def _compact(self, compactions: list[Compaction]) -> None:
        """Run every round of this step; rounds of equal shape share one selection."""
        groups: dict[tuple, list[Compaction]] = defaultdict(list)
        for c in compactions:
            r = c.region
            groups[(r.n_compress, r.span, r.n_queries, r.budget, c.config)].append(c)
        for (n_compress, span, n_queries, budget, config), group in groups.items():
            start = time.perf_counter()
            self._compact_group(group, n_compress, span, n_queries, budget, config)
            share = (time.perf_counter() - start) / len(group)
            for c in group:
                self.kv_seconds[c.req_id] = self.kv_seconds.get(c.req_id, 0.0) + share

    def _compact_group(
        self, group: list[Compaction], n_compress: int, span: int, n_queries: int, budget: int, config: Any
    ) -> None:
        """One selection for every request of the group; each layer read and written once.

        The scheduler freed the round's blocks when it planned it, so the rewrite must run
        whatever happens to the selection. A selection that raises (a method that cannot
        run on this model, a bad calibration file, a bug) keeps the area's newest slots
        instead, what StreamingLLM would keep there, and the scheduler hears of it: the
        round is counted refused and the request compresses no more. Every other request
        of the step, and the engine, go on as if nothing happened.
        """
        bs = self.cache_config.block_size
        tables = [torch.tensor(self.requests[c.req_id].block_ids[0], dtype=torch.long) for c in group]
        try:
            kept = self._selection(group, tables, n_compress, span, n_queries, budget, config)
        except Exception as err:  # contained to the group's requests, and reported
            ids = [c.req_id for c in group]
            logger.warning("requests %s: compression round failed, newest slots kept: %r", ids, err)
            for req_id in ids:
                self.kv_failed[req_id] = repr(err)
                self.kv_carry.pop(req_id, None)
            kept = self._newest(len(group), n_compress, budget)
        if self.kv_tp_size > 1:  # this rank's KV heads, in vLLM's contiguous split
            local = kept.shape[2] // self.kv_tp_size
            kept = kept[:, :, self.kv_tp_rank * local : (self.kv_tp_rank + 1) * local]
        self._rewrite(group, kept, tables, bs)

    def _newest(self, n_requests: int, n_compress: int, budget: int) -> torch.Tensor:
        """``[B, L, Hkv, budget]``: each area's newest ``budget`` slots, as many as the scheduler keeps."""
        heads = self.kv_layers[0].num_kv_heads * self.kv_tp_size
        newest = torch.arange(n_compress - budget, n_compress)
        return newest.expand(n_requests, len(self.kv_layers), heads, budget)

    def _selection(
        self,
        group: list[Compaction],
        tables: list[torch.Tensor],
        n_compress: int,
        span: int,
        n_queries: int,
        budget: int,
        config: Any,
    ) -> torch.Tensor:
        """The group's kept indices, ``[B, L, Hkv, m]`` over all KV heads."""
        bs = self.cache_config.block_size
        ring = self.kv_ring
        offsets = torch.arange(span)
        span_slots = torch.stack(
            [paged.slots_of(t, c.region.start + offsets, bs) for c, t in zip(group, tables, strict=True)]
        )  # [B, span]
        # The scoring queries are the span's last tokens: tail slots, never compressed.
        first = torch.tensor([c.region.start + span - n_queries + c.dropped for c in group])
        positions = (first.unsqueeze(1) + torch.arange(n_queries)) % ring.ring  # [B, nq]
        ring_slots = torch.tensor([ring.slot(c.req_id) for c in group]).unsqueeze(1)
        method = build(config)
        caches = [layer.kv_cache for layer in self.kv_layers]
        keys, values = paged.read_spans(caches, span_slots, values=method.reads_values)
        queries = [q[ring_slots, positions].permute(0, 2, 1, 3) for q in ring.queries]  # [B, Hq, nq, D] each
        window = Window(
            queries=self._all_heads(torch.stack(queries, dim=1)),  # [B, L, Hq, nq, D]
            keys=self._all_heads(keys),  # [B, L, Hkv, span, D]
            n_compress=n_compress,
            seeds=tuple(c.seed for c in group),
            # Slots before the region were compacted; the span's own keys are consecutive.
            positions=tuple(c.region.start + c.dropped for c in group),
            values=None if values is None else self._all_heads(values),
            rope=self.kv_rope,
        )
        return self._select(group, method, window, budget, config).indices

    def _select(self, group: list[Compaction], method: Any, window: Window, budget: int, config: Any) -> Selection:
        """The group's selection; under lazy retention, with each request's carried scores
        (every rank keeps all heads' scores: each selects on all heads)."""
        if config.lazy == 1:
            return method.select(window, budget)
        n = group[0].region.candidates  # one count per group: it sets the area's size
        carried = torch.stack([self.kv_carry[c.req_id] for c in group]) if n and config.lazy_keep > 0 else None
        selection, carry = lazy_select(method, window, config.lazy_round(n), carried)
        for c, row in zip(group, carry, strict=True):
            self.kv_carry[c.req_id] = row
        return selection

    def _all_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, L, heads of this rank, ...]`` gathered over the TP ranks, in rank order."""
        if self.kv_tp_size == 1:
            return x
        return tensor_model_parallel_all_gather(x.contiguous(), dim=2)

    def _rewrite(self, group: list[Compaction], kept: torch.Tensor, tables: list[torch.Tensor], bs: int) -> None:
        """Per request: kept slots, then the rest of the sequence, written contiguously from
        the region start. All requests of the group go through one read and one write per layer."""
        n_layers, heads = kept.shape[1:3]
        src, dst = [], []
        for c, idx, table in zip(group, kept, tables, strict=True):
            r = c.region
            tail = torch.arange(r.start + r.n_compress, c.length).expand(n_layers, heads, -1)
            positions = torch.cat([r.start + idx, tail], dim=-1)  # [L, Hkv, n]
            src.append(paged.slots_of(table, positions, bs))
            dst.append(paged.slots_of(table, torch.arange(r.start, r.start + positions.shape[-1]), bs))
        src_slots, dst_slots = torch.cat(src, dim=-1), torch.cat(dst)
        for i, layer in enumerate(self.kv_layers):
            # Read everything first: within a request, sources and destinations overlap.
            k, v = paged.read(layer.kv_cache, src_slots[i])  # [Hkv, n, D]
            paged.write(layer.kv_cache, k.transpose(0, 1), v.transpose(0, 1), dst_slots, layer.isa)

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)
        if (self.kv_seconds or self.kv_failed) and dataclasses.is_dataclass(out):
            # Hand this step's compaction time and failed rounds to the scheduler (pickled
            # back with the output). A copy: the output may be vLLM's shared empty singleton.
            out = dataclasses.replace(out)
            out.kvllm_seconds, out.kvllm_failed = self.kv_seconds, self.kv_failed
            self.kv_seconds, self.kv_failed = {}, {}
        return out


def _rope_of(model: torch.nn.Module) -> Rope | None:
    """The model's RoPE table for methods that undo the rotation; ``None`` if not neox RoPE.

    vLLM builds one rotary layer per distinct configuration (``get_rope`` caches them), and
    its ``cos_sin_cache`` already has :class:`~kvllm.methods.rope.Rope`'s layout, so the
    table is the model's own, scaled types included. M-RoPE layers (``RotaryEmbeddingBase``
    subclasses of another shape) and GPT-J-style layers are not covered: the methods that
    need the table then raise a clear error (``Window.require``).
    """
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            return Rope(module.cos_sin_cache) if module.is_neox_style else None
    return None
