"""A worker's EPLB state (vLLM's ``EplbState``): the maps of every MoE layer it manages, the
heat window, the step counter, and the rearrangement in progress.

Every rank runs the same SchedulerOutputs, so every rank calls ``step()`` the same number of
times and reaches each decision at the same step. Per step (after the forward):

- the step's per-slot token counts (each rank counts the slots it serves; the MoE layers add
  into ``step_load`` as they run) go into a sliding window of ``window_size`` steps;
- every ``step_interval`` steps (seed step 53) the window is summed, all-reduced over the EP
  group and folded into per-logical-expert load; DeepSeek's algorithm gives a new placement
  (step 54), rank 0's copy of which every rank takes, and the weights move: every layer now,
  or one layer per step with ``use_async`` (a layer's maps change with its weights, so each
  layer is always consistent).

Warm-up and other dummy forwards are not counted: ``step()`` clears what they added.
"""
from __future__ import annotations

import logging
import time

import torch

from lane.config import EplbConfig
from lane.eplb import mover
from lane.eplb.placement import (ExpertMap, balancedness, expected_physical_load, initial_phy2log, keep_in_place,
                                 logical_maps, rank_loads)
from lane.eplb.rebalance import rebalance_experts
from lane.metrics.stats import EplbStats
from lane.tracing import Step, tracer

logger = logging.getLogger(__name__)


class EplbState:
    def __init__(self, moe_layers: dict, config: EplbConfig, ep, num_groups: int = 1, num_nodes: int = 1) -> None:
        """``moe_layers``: layer index -> FusedMoE (built with EPLB's placement); ``ep``: the
        expert-parallel GroupCoordinator."""
        self.config, self.ep = config, ep
        self.layer_ids = sorted(moe_layers)
        self.layers = [moe_layers[i] for i in self.layer_ids]
        first = self.layers[0]
        self.num_logical, self.num_physical = first.num_experts, first.num_physical
        self.num_groups, self.num_nodes = num_groups, num_nodes
        L, P = len(self.layers), self.num_physical
        self.phy2log = initial_phy2log(L, self.num_logical, P)
        self.log2phy, self.replica_count = logical_maps(self.phy2log, self.num_logical)
        self.step_load = torch.zeros(L, P, dtype=torch.long)
        self.window = torch.zeros(config.window_size, L, P, dtype=torch.long)
        for j, layer in enumerate(self.layers):  # the layers read and write views of these
            layer.expert_map = ExpertMap(self.phy2log[j], self.log2phy[j], self.replica_count[j])
            layer.eplb_load = self.step_load[j]
        self.steps = 0
        self._pos = 0
        self._pending: list[tuple[int, torch.Tensor]] = []  # async: (layer position, its new phy2log)
        self._move: dict = {}  # the rearrangement under way: its start, figures so far
        self._fault = mover.fault_hook_for(ep.rank_in_group)
        self.stats = EplbStats()
        self._stats_changed = True

    # -- start-up (seed step 7) -----------------------------------------------------------
    def describe(self) -> dict:
        local = self.num_physical // self.ep.world_size
        return dict(layers=len(self.layers), logical_experts=self.num_logical, physical_slots=self.num_physical,
                    redundant=self.num_physical - self.num_logical, ep=self.ep.world_size,
                    slots=f"{self.ep.rank_in_group * local}-{(self.ep.rank_in_group + 1) * local - 1}",
                    experts=self.phy2log[0, self.ep.rank_in_group * local:(self.ep.rank_in_group + 1) * local].tolist(),
                    window_size=self.config.window_size, step_interval=self.config.step_interval,
                    use_async=self.config.use_async)

    def clear_step(self) -> None:
        """Forget what a dummy forward added."""
        self.step_load.zero_()

    # -- every step --------------------------------------------------------------------------
    def step(self) -> EplbStats | None:
        """After a real forward: window, logging, the decision, the moves. Returns the stats when
        they changed since the last call (for the engine's metrics), else None."""
        self.window[self._pos].copy_(self.step_load)
        self.step_load.zero_()
        last = self.window[self._pos]
        self._pos = (self._pos + 1) % self.config.window_size
        self.steps += 1
        cfg = self.config
        if cfg.log_balancedness and self.steps % cfg.log_balancedness_interval == 0:
            self._log_balancedness(last.clone())
        if self._pending:
            self._move_next()
        elif self.steps % cfg.step_interval == 0:
            self.rearrange()
        if not self._stats_changed:
            return None
        self._stats_changed = False
        s = self.stats
        return EplbStats(s.balancedness_min, s.balancedness_p50, s.rebalance_events, s.rebalancing,
                         list(s.rearrangement_seconds), s.moved_bytes)

    def _log_balancedness(self, load: torch.Tensor) -> None:
        """vLLM's line, from this step's tokens per EP rank summed over the layers."""
        self.ep.all_reduce(load, Step.EPLB_COLLECT)
        per_rank = rank_loads(load, self.ep.world_size).double()
        avg, peak = per_rank.mean(-1).sum().item(), per_rank.max(-1).values.sum().item()
        if self.ep.rank_in_group == 0:
            logger.info("EPLB step: avg_tokens=%.2f, max_tokens=%d, balancedness=%.4f", avg, int(peak),
                        avg / peak if peak else 1.0)

    # -- seed steps 53 and 54 ------------------------------------------------------------------
    def rearrange(self) -> None:
        t0 = time.monotonic()
        load = self.window.sum(0)  # [L, P]: this rank's slots' tokens over the window
        self.ep.all_reduce(load, Step.EPLB_COLLECT)
        logical = torch.zeros(len(self.layers), self.num_logical, dtype=torch.long).scatter_add_(1, self.phy2log, load)
        ep = self.ep.world_size
        per_rank = rank_loads(load, ep)
        before = balancedness(per_rank)
        t1 = time.monotonic()
        self._set_balancedness(before)
        if tracer.enabled:
            tracer.record(Step.EPLB_COLLECT, t0, t1, window_steps=min(self.steps, self.config.window_size),
                          routed=int(logical.sum()), layers=len(self.layers),
                          balancedness_min=round(before.min().item(), 4),
                          balancedness_p50=round(before.median().item(), 4),
                          rank_tokens=per_rank.sum(0).tolist())  # over the window, all layers
        new, _ = rebalance_experts(logical, self.num_physical, self.num_groups, self.num_nodes, ep)
        new = keep_in_place(self.phy2log, new, ep)
        self.ep.broadcast(new, Step.EPLB_REBALANCE)  # rank 0's: every rank moves by the same plan
        _, count = logical_maps(new, self.num_logical)
        after = balancedness(rank_loads(expected_physical_load(logical, new, count), ep))
        self._pending = [(j, new[j].clone()) for j in range(len(self.layers)) if not torch.equal(new[j], self.phy2log[j])]
        t_decided = time.monotonic()
        # work_s: this rearrangement's own time (with use_async, the steps between its layers not counted)
        self._move = dict(t0=t0, t_decided=t_decided, work_s=t_decided - t0, layers=0, experts=0, local_copies=0,
                          bytes=0, before=before, after=after)
        self.stats.rebalance_events += 1
        self.stats.rebalancing = True
        self._stats_changed = True
        if not self.config.use_async:
            while self._pending:
                self._move_next()
        elif not self._pending:
            self._finish()
        else:
            self._move_next()  # the first layer now, one more each step

    def _move_next(self) -> None:
        j, new = self._pending.pop(0)
        t0 = time.monotonic()
        layer = self.layers[j]
        plan = mover.plan_layer(self.phy2log[j].tolist(), new.tolist(), self.ep.world_size)
        tensors = layer.slot_tensors()
        fault, self._fault = self._fault, None  # once
        mover.move_layer(plan, tensors, self.ep.rank_in_group, self.ep.ranks, self.ep.group, fault)
        self.phy2log[j].copy_(new)  # the maps change with the weights
        log2phy, count = logical_maps(new.unsqueeze(0), self.num_logical)
        self.log2phy[j].copy_(log2phy[0])
        self.replica_count[j].copy_(count[0])
        m = self._move
        nbytes = plan.experts_moved * mover.slot_bytes(tensors)
        m["work_s"] += time.monotonic() - t0
        m["layers"] += 1
        m["experts"] += plan.experts_moved
        m["local_copies"] += len(plan.local_copies)
        m["bytes"] += nbytes
        if tracer.enabled and self.config.use_async:  # a span per layer: each runs in its own step
            tracer.record(Step.EPLB_REBALANCE, t0, time.monotonic(), layer=self.layer_ids[j],
                          experts_moved=plan.experts_moved, local_copies=len(plan.local_copies), bytes=nbytes,
                          layers_left=len(self._pending), use_async=True,
                          balancedness_before=round(m["before"][j].item(), 4),
                          balancedness_after=round(m["after"][j].item(), 4))
        if not self._pending:
            self._finish()

    def _finish(self) -> None:
        m, now = self._move, time.monotonic()
        self.stats.rebalancing = False
        self.stats.rearrangement_seconds.append(m["work_s"])
        self.stats.moved_bytes += m["bytes"]
        self._stats_changed = True
        before, after = m["before"], m["after"]
        if tracer.enabled and not self.config.use_async:
            tracer.record(Step.EPLB_REBALANCE, m["t_decided"], now, layers_moved=m["layers"],
                          experts_moved=m["experts"], local_copies=m["local_copies"], bytes=m["bytes"],
                          ms=round(m["work_s"] * 1e3, 3), balancedness_before=round(before.min().item(), 4),
                          balancedness_after=round(after.min().item(), 4), use_async=False)
        if self.ep.rank_in_group == 0:
            logger.info("EPLB rearrangement %d: %d layers, %d experts moved between ranks (%.1f KiB), %d local "
                        "copies in %.1f ms; balancedness (worst layer) %.3f -> %.3f expected",
                        self.stats.rebalance_events, m["layers"], m["experts"], m["bytes"] / 1024,
                        m["local_copies"], m["work_s"] * 1e3, before.min().item(), after.min().item())

    def _set_balancedness(self, per_layer: torch.Tensor) -> None:
        self.stats.balancedness_min = round(per_layer.min().item(), 6)
        self.stats.balancedness_p50 = round(per_layer.median().item(), 6)
        self._stats_changed = True
