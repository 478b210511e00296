"""Model-free tests of the Scheduler: KV cache configs are built by hand and the model
runner is stood in for by ``Runner``, which knows only what the SchedulerOutputs tell it
(as a worker in another process would) and answers with ModelRunnerOutputs of scripted
tokens. Every expected number below is derived by hand (blocks of 4 tokens; the free
queue hands out the lowest unused ids first, freed blocks at its tail, a request's tail
first)."""
from __future__ import annotations

import pickle

import msgspec
import pytest

from lane.config import SchedulerConfig
from lane.core.request import Request, RequestStatus
from lane.core.scheduler import Scheduler
from lane.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lane.kv_cache_interface import FULL, SLIDING_WINDOW, STATE, KVCacheConfig, KVCacheGroupSpec
from lane.outputs import ModelRunnerOutput
from lane.sampling_params import SamplingParams
from lane.tracing.steps import Step

BS = 4
EOS = 2


def make_scheduler(num_blocks: int = 64, *, budget: int = 64, max_num_seqs: int = 8,
                   max_model_len: int = 256, caching: bool = True, window: tuple[int, int] | None = None,
                   state_slots: int | None = None) -> Scheduler:
    """A full group of ``num_blocks`` (null block included), optionally a sliding window
    group (num_blocks, window) and a running-state group of ``state_slots`` (slot 0 included)."""
    groups, sizes = [KVCacheGroupSpec(FULL, BS, [], [])], [num_blocks]
    if window is not None:
        groups.append(KVCacheGroupSpec(SLIDING_WINDOW, BS, [], [], sliding_window=window[1]))
        sizes.append(window[0])
    if state_slots is not None:
        groups.append(KVCacheGroupSpec(STATE, BS, [], []))
        sizes.append(state_slots)
    return Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len), KVCacheConfig(groups, sizes),
                     enable_prefix_caching=caching, eos_token_ids=[EOS])


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def add(sched: Scheduler, rid: str, prompt: list[int], **sp) -> Request:
    sp.setdefault("max_tokens", 100)
    r = Request(rid, list(prompt), SamplingParams(**sp))
    sched.add_request(r)
    return r


class Runner:
    """The model runner's side of the boundary: its own view of each request (tokens it
    knows, tokens computed, block table of the full group), built only from
    SchedulerOutputs. It samples when a request's last known token is computed: the next
    scripted token, else ``default``."""

    def __init__(self, script: dict[str, list[int]] | None = None, default: int = 100) -> None:
        self.script = {rid: list(t) for rid, t in (script or {}).items()}
        self.default = default
        self.reqs: dict[str, dict] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.reqs[rid]["blocks"] = None
        for nr in out.scheduled_new_reqs:
            assert nr.req_id not in self.reqs
            self.reqs[nr.req_id] = dict(tokens=len(nr.prompt_token_ids), computed=nr.num_computed_tokens,
                                        blocks=[list(g) for g in nr.block_ids])
        c = out.scheduled_cached_reqs
        for rid, resumed, new_ids, computed in zip(c.req_ids, c.resumed_from_preemption, c.new_block_ids,
                                                   c.num_computed_tokens):
            st = self.reqs[rid]
            if resumed:  # all its blocks are new
                st["blocks"], st["computed"] = [list(g) for g in new_ids], computed
            else:
                assert computed == st["computed"], rid  # the scheduler's count is the runner's
                if new_ids is not None:
                    for table, ids in zip(st["blocks"], new_ids):
                        table.extend(ids)
        ro = ModelRunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            st = self.reqs[rid]
            st["computed"] += n
            assert st["computed"] <= st["tokens"], rid
            if st["computed"] == st["tokens"]:
                script = self.script.get(rid)
                ro.req_ids.append(rid)
                ro.sampled_token_ids.append([script.pop(0) if script else self.default])
                st["tokens"] += 1
        return ro


def step(sched: Scheduler, runner: Runner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def cached(out: SchedulerOutput) -> list[tuple]:
    c = out.scheduled_cached_reqs
    return list(zip(c.req_ids, c.resumed_from_preemption, c.new_block_ids, c.num_computed_tokens))


# -- budgets, chunked prefill --------------------------------------------------------------

def test_chunked_prefill_then_decode_blocks_and_progress():
    sched, runner = make_scheduler(budget=8), Runner()
    a = add(sched, "a", toks(10, 20))
    out, outputs = step(sched, runner)
    assert out.scheduled_new_reqs == [NewRequestData("a", toks(10, 20), a.sampling_params, ([1, 2],), 0)]
    assert out.num_scheduled_tokens == {"a": 8} and out.total_num_scheduled_tokens == 8
    assert cached(out) == [] and outputs == [] and a.num_computed_tokens == 8
    expected = [  # (tokens this step, new blocks, computed before it)
        (8, ([3, 4],), 8),
        (4, ([5],), 16),  # the prompt's last 4 tokens: a token is sampled
        (1, ([6],), 20),  # token 20 starts block 5
        (1, None, 21),
        (1, None, 22),
    ]
    for n, new_ids, computed in expected:
        out, outputs = step(sched, runner)
        assert out.scheduled_new_reqs == []
        assert out.num_scheduled_tokens == {"a": n} and out.total_num_scheduled_tokens == n
        assert cached(out) == [("a", False, new_ids, computed)]
        assert a.num_computed_tokens == computed + n
    assert a.output_token_ids == [100, 100, 100, 100] and a.num_tokens == 24
    assert sched.kv.get_block_ids("a") == ([1, 2, 3, 4, 5, 6],)
    assert runner.reqs["a"]["blocks"] == [[1, 2, 3, 4, 5, 6]]


def test_decodes_share_a_step_with_a_prefill_chunk():
    sched, runner = make_scheduler(budget=8), Runner()
    add(sched, "a", toks(10, 3))
    b = add(sched, "b", toks(50, 20))
    out, _ = step(sched, runner)
    assert [(nr.req_id, nr.block_ids) for nr in out.scheduled_new_reqs] == [("a", ([1],)), ("b", ([2, 3],))]
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    out, _ = step(sched, runner)  # a's decode, then the rest of the budget to b
    assert out.num_scheduled_tokens == {"a": 1, "b": 7} and out.total_num_scheduled_tokens == 8
    assert cached(out) == [("a", False, None, 3), ("b", False, ([4],), 5)]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert cached(out) == [("a", False, ([5],), 4), ("b", False, ([6, 7],), 12)]
    out, outputs = step(sched, runner)  # b's last prompt token: both sample
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.total_num_scheduled_tokens == 2
    assert [o.request_id for o in outputs] == ["a", "b"] and b.num_output_tokens == 1


def test_token_budget_limits_admissions():
    sched, runner = make_scheduler(budget=10), Runner()
    for rid, start in (("a", 10), ("b", 20), ("c", 30)):
        add(sched, rid, toks(start, 6))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}  # b gets what is left; c waits
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2, "c": 6}
    assert [nr.req_id for nr in out.scheduled_new_reqs] == ["c"]


def test_max_num_seqs_limits_running_requests():
    sched, runner = make_scheduler(max_num_seqs=2), Runner()
    add(sched, "a", toks(10, 4), max_tokens=1)
    add(sched, "b", toks(20, 4))
    add(sched, "c", toks(30, 4))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert outputs[0].finish_reason == "length"  # a: max_tokens 1
    out, _ = step(sched, runner)  # a's place goes to c
    assert [nr.req_id for nr in out.scheduled_new_reqs] == ["c"]
    assert out.num_scheduled_tokens == {"b": 1, "c": 4}
    assert out.finished_req_ids == ["a"]


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", [4, 5])


# -- preemption ------------------------------------------------------------------------------

def _run_to_preemption():
    """4 usable blocks, 4 tokens a step. a (3 tokens) and c (5) run; d (4) waits for a
    block from step 3 on. After 6 steps a and c each hold 2 blocks and 9 tokens, 8 computed."""
    sched = make_scheduler(5, budget=4, caching=False)
    runner = Runner()
    a = add(sched, "a", toks(10, 3))
    c = add(sched, "c", toks(20, 5))
    d = add(sched, "d", toks(30, 4))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 3, "c": 1}
    assert [(nr.req_id, nr.block_ids) for nr in out.scheduled_new_reqs] == [("a", ([1],)), ("c", ([2],))]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "c": 3}
    out, _ = step(sched, runner)  # both cross into a second block; d finds none free
    assert cached(out) == [("a", False, ([3],), 4), ("c", False, ([4],), 4)]
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}
    for _ in range(3):
        out, _ = step(sched, runner)
        assert out.num_scheduled_tokens == {"a": 1, "c": 1} and out.preempted_req_ids == []
    assert (a.num_computed_tokens, a.num_tokens, c.num_computed_tokens, c.num_tokens) == (8, 9, 8, 9)
    assert sched.kv.pool.num_free_blocks == 0 and [r.request_id for r in sched.waiting] == ["d"]
    return sched, runner, a, c, d


def test_preemption_takes_the_newest_running_request_and_admits_nothing():
    sched, runner, a, c, d = _run_to_preemption()
    out, _ = step(sched, runner)  # a needs a third block: c (newest) is preempted, its block 4 goes to a
    assert out.preempted_req_ids == ["c"]
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_new_reqs == []
    assert cached(out) == [("a", False, ([4],), 8)]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.num_preemptions == 1 and sched.running == [a]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # front of the queue
    # block 2 is free and 3 tokens of budget were left: c could have had a chunk, but no
    # request is admitted in a step that preempted
    assert sched.kv.get_block_ids("c") == ([],) and list(sched.kv.pool.free_queue) == [2]
    assert c.num_tokens == 9  # its sampled tokens stay; they are recomputed


def test_preempted_request_resumes_as_cached_data_with_all_its_blocks():
    sched, runner, a, c, d = _run_to_preemption()
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs == [] and out.preempted_req_ids == []
    assert cached(out) == [("a", False, None, 9), ("c", True, ([2],), 0)]
    assert out.num_scheduled_tokens == {"a": 1, "c": 3}  # c recomputes from token 0
    assert c.status == RequestStatus.RUNNING and [r.request_id for r in sched.waiting] == ["d"]
    for rid in ("a", "c"):  # the runner's tables, built from the outputs alone, are the cache's
        assert runner.reqs[rid]["blocks"] == list(sched.kv.get_block_ids(rid))
    assert sched.kv.get_block_ids("a") == ([1, 3, 4],)


def test_preempting_the_request_that_needs_the_blocks_itself():
    sched, runner = make_scheduler(4, budget=8, caching=False), Runner()  # 3 usable blocks
    a = add(sched, "a", toks(10, 12))
    step(sched, runner)  # 8 tokens: blocks 1, 2
    b = add(sched, "b", toks(50, 1))
    out, _ = step(sched, runner)  # a's last 4 tokens take block 3; b finds no block
    assert out.num_scheduled_tokens == {"a": 4} and cached(out) == [("a", False, ([3],), 8)]
    assert out.scheduled_new_reqs == []
    out, _ = step(sched, runner)  # a's decode needs a 4th block: a is the only running request
    assert out.preempted_req_ids == ["a"] and out.num_scheduled_tokens == {} and out.is_empty
    assert a.status == RequestStatus.PREEMPTED and [r.request_id for r in sched.waiting] == ["a", "b"]
    assert sched.kv.pool.num_free_blocks == 3
    assert b.status == RequestStatus.WAITING


# -- the data boundary ----------------------------------------------------------------------

def test_finished_ids_wait_for_the_next_nonempty_output():
    sched, runner = make_scheduler(), Runner()
    add(sched, "a", toks(10, 4), max_tokens=1)
    _, outputs = step(sched, runner)
    assert outputs[0].finish_reason == "length" and not sched.has_unfinished()
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == []  # no step runs: the workers hear later
    add(sched, "b", toks(20, 4))
    out, _ = step(sched, runner)
    assert out.finished_req_ids == ["a"] and "a" not in runner.reqs
    out, _ = step(sched, runner)
    assert out.finished_req_ids == []


def test_prefix_hit_is_new_request_data_with_computed_tokens_and_counted():
    sched, runner = make_scheduler(), Runner()
    a = add(sched, "a", toks(10, 10))
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (10, 0)
    b = add(sched, "b", toks(10, 10))
    out, outputs = step(sched, runner)
    # a's two full blocks: 8 tokens; b computes tokens 8, 9 in a new block
    assert out.scheduled_new_reqs == [NewRequestData("b", toks(10, 10), b.sampling_params, ([1, 2, 4],), 8)]
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (20, 8)
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 8}
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.kv_cache_usage == pytest.approx(4 / 63)


def test_prefix_caching_off_counts_nothing():
    sched, runner = make_scheduler(caching=False), Runner()
    add(sched, "a", toks(10, 10))
    step(sched, runner)
    add(sched, "b", toks(10, 10))
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens["b"] == 10
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (0, 0)


def _outputs_of_every_kind() -> list[SchedulerOutput]:
    """New requests, cached ones with and without new blocks, a preemption, a resume and
    finished ids, from one run."""
    sched, runner, a, c, d = _run_to_preemption()
    outs = []
    for _ in range(2):
        out, _ = step(sched, runner)
        outs.append(out)
    sched.finish_requests(["a", "d"], RequestStatus.FINISHED_ABORTED)
    e = add(sched, "e", [7, 8], max_tokens=3, temperature=0.5, stop=["x"], stop_token_ids=[9], logprobs=2)
    outs.append(step(sched, runner)[0])  # c's 4 tokens take the budget
    outs.append(step(sched, runner)[0])  # c's last 2 prompt tokens, then e
    assert outs[0].preempted_req_ids == ["c"] and outs[1].scheduled_cached_reqs.resumed_from_preemption == [False, True]
    assert outs[2].finished_req_ids == ["a", "d"] and outs[2].num_scheduled_tokens == {"c": 4}
    assert [nr.req_id for nr in outs[3].scheduled_new_reqs] == ["e"]
    assert outs[3].scheduled_new_reqs[0].sampling_params is e.sampling_params
    return outs


def test_scheduler_output_round_trips_through_msgspec():
    for out in _outputs_of_every_kind():
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
        assert back == out
        assert isinstance(back.scheduled_cached_reqs, CachedRequestData)
        for nr in back.scheduled_new_reqs:
            assert isinstance(nr.block_ids, tuple) and isinstance(nr.sampling_params, SamplingParams)
        for ids in back.scheduled_cached_reqs.new_block_ids:
            assert ids is None or isinstance(ids, tuple)


def test_scheduler_output_round_trips_through_pickle():
    for out in _outputs_of_every_kind():
        assert pickle.loads(pickle.dumps(out)) == out


def test_hand_built_output_round_trips():
    sp = SamplingParams(max_tokens=5, stop_token_ids=[3])
    out = SchedulerOutput(
        [NewRequestData("n", [1, 2, 3], sp, ([1, 2], [0, 5], [1]), 4)],
        CachedRequestData(["c", "r"], [False, True], [None, ([7], [], [])], [12, 0]),
        {"n": 3, "c": 1, "r": 8}, 12, ["f"], ["p"])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert back == out and back.scheduled_new_reqs[0].block_ids == ([1, 2], [0, 5], [1])
    assert back.scheduled_cached_reqs.new_block_ids == [None, ([7], [], [])]
    assert pickle.loads(pickle.dumps(out)) == out


# -- stop conditions -------------------------------------------------------------------------

def _decode(sched: Scheduler, runner: Runner, steps: int):
    return [step(sched, runner)[1] for _ in range(steps)]


def test_stop_on_eos():
    sched, runner = make_scheduler(), Runner({"a": [5, EOS, 6]})
    a = add(sched, "a", toks(10, 4))
    first, second = _decode(sched, runner, 2)
    assert first[0].new_token_ids == [5] and first[0].finish_reason is None
    assert second[0].new_token_ids == [EOS]
    assert (second[0].finish_reason, second[0].stop_reason) == ("stop", None)
    assert a.status == RequestStatus.FINISHED_STOPPED and "a" not in sched.requests
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 63


def test_ignore_eos_keeps_going():
    sched, runner = make_scheduler(), Runner({"a": [EOS, EOS, EOS]})
    a = add(sched, "a", toks(10, 4), ignore_eos=True, max_tokens=3)
    outs = _decode(sched, runner, 3)
    assert [o[0].finish_reason for o in outs] == [None, None, "length"]
    assert a.output_token_ids == [EOS, EOS, EOS]


def test_stop_token_ids_set_the_stop_reason():
    sched, runner = make_scheduler(), Runner({"a": [5, 9]})
    add(sched, "a", toks(10, 4), stop_token_ids=[9])
    outs = _decode(sched, runner, 2)
    assert (outs[1][0].finish_reason, outs[1][0].stop_reason) == ("stop", 9)


def test_min_tokens_hold_back_eos_and_stop_tokens():
    sched, runner = make_scheduler(), Runner({"a": [EOS, 9, EOS]})
    a = add(sched, "a", toks(10, 4), min_tokens=3, stop_token_ids=[9])
    outs = _decode(sched, runner, 3)
    assert [o[0].finish_reason for o in outs] == [None, None, "stop"]
    assert a.output_token_ids == [EOS, 9, EOS]


def test_max_tokens_caps_the_length():
    sched, runner = make_scheduler(), Runner()
    a = add(sched, "a", toks(10, 4), max_tokens=3)
    outs = _decode(sched, runner, 3)
    assert [o[0].finish_reason for o in outs] == [None, None, "length"]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_output_tokens == 3


def test_max_model_len_caps_the_length():
    sched, runner = make_scheduler(max_model_len=6), Runner()
    a = add(sched, "a", toks(10, 4), max_tokens=50)
    outs = _decode(sched, runner, 2)  # 4 + 2 tokens = max_model_len
    assert [o[0].finish_reason for o in outs] == [None, "length"] and a.num_tokens == 6


def test_several_sampled_tokens_stop_at_the_stop_token():
    sched = make_scheduler()
    a = add(sched, "a", toks(10, 4), stop_token_ids=[9])
    out = sched.schedule()
    outputs = sched.update_from_output(out, ModelRunnerOutput(["a"], [[5, 9, 6]]))
    assert outputs[0].new_token_ids == [5, 9] and outputs[0].stop_reason == 9
    assert a.output_token_ids == [5, 9]


# -- aborts ------------------------------------------------------------------------------------

def test_abort_a_waiting_request():
    sched, runner = make_scheduler(max_num_seqs=1), Runner()
    add(sched, "a", toks(10, 4))
    b = add(sched, "b", toks(20, 4))
    step(sched, runner)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and list(sched.waiting) == []
    assert "b" not in sched.requests
    out, _ = step(sched, runner)
    assert out.finished_req_ids == ["b"] and out.num_scheduled_tokens == {"a": 1}
    sched.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED)  # twice, or unknown: nothing
    assert sched.finished_req_ids == []


def test_abort_a_running_request_frees_its_blocks_and_skips_its_output():
    sched, runner = make_scheduler(), Runner()
    a = add(sched, "a", toks(10, 6))
    b = add(sched, "b", toks(10, 6))  # admitted with a, before a's blocks exist: no hit
    step(sched, runner)
    assert sched.kv.get_block_ids("a") == ([1, 2],) and sched.kv.get_block_ids("b") == ([3, 4],)
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outputs = sched.update_from_output(out, runner.execute(out))  # a's token is dropped
    assert [o.request_id for o in outputs] == ["b"] and a.num_output_tokens == 1
    assert sched.running == [b] and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.get_block_ids("a") == ([],) and sched.kv.pool.num_free_blocks == 61
    out, _ = step(sched, runner)
    assert out.finished_req_ids == ["a"]


def test_abort_a_preempted_request():
    sched, runner, a, c, d = _run_to_preemption()
    step(sched, runner)  # c preempted
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == ["d"] and "c" not in sched.requests
    out, _ = step(sched, runner)  # d, not c, takes the free block
    assert [nr.req_id for nr in out.scheduled_new_reqs] == ["d"] and out.finished_req_ids == ["c"]
    assert out.num_scheduled_tokens == {"a": 1, "d": 3}
    assert sched.kv.get_block_ids("d") == ([2],)


# -- sliding window and running state in the scheduler -------------------------------------------

def test_window_group_blocks_per_group_and_release():
    sched, runner = make_scheduler(budget=16, window=(8, 8)), Runner()
    add(sched, "a", toks(10, 12))
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3], [1, 2, 3])
    # the next query (position 12) sees 5..12: window block 0 is released
    assert sched.kv.get_block_ids("a") == ([1, 2, 3], [0, 2, 3])
    assert sched.kv.coordinator.managers[1].pool.num_free_blocks == 5
    out, _ = step(sched, runner)
    assert cached(out) == [("a", False, ([4], [4]), 12)]
    out, _ = step(sched, runner)
    assert cached(out) == [("a", False, None, 13)]


def test_running_state_slots_bound_admissions_and_return_on_finish():
    sched, runner = make_scheduler(state_slots=3), Runner()  # 2 usable slots
    add(sched, "a", toks(10, 4), max_tokens=2)
    add(sched, "b", toks(20, 4))
    add(sched, "c", toks(30, 4))
    out, _ = step(sched, runner)
    assert [(nr.req_id, nr.block_ids) for nr in out.scheduled_new_reqs] == [("a", ([1], [1])), ("b", ([2], [2]))]
    assert [r.request_id for r in sched.waiting] == ["c"]  # no slot: it waits, nothing is preempted
    assert out.preempted_req_ids == []
    out, _ = step(sched, runner)  # decodes cross into a second block: a new full block, no new slot
    assert cached(out) == [("a", False, ([3], []), 4), ("b", False, ([4], []), 4)]
    assert not sched.requests.get("a")  # a: max_tokens 2, finished
    out, _ = step(sched, runner)
    # a's slot 1 is back; a's full blocks went to the tail of the queue
    assert [(nr.req_id, nr.block_ids) for nr in out.scheduled_new_reqs] == [("c", ([5], [1]))]
    assert out.finished_req_ids == ["a"]


def test_preemption_returns_the_state_slot():
    sched, runner = make_scheduler(4, caching=False, state_slots=3), Runner()  # 3 blocks, 2 slots
    a = add(sched, "a", toks(10, 4))
    b = add(sched, "b", toks(20, 8))
    out, _ = step(sched, runner)
    assert [(nr.req_id, nr.block_ids) for nr in out.scheduled_new_reqs] == [("a", ([1], [1])), ("b", ([2, 3], [2]))]
    out, _ = step(sched, runner)  # a needs a second block: b is preempted
    assert out.preempted_req_ids == ["b"] and cached(out) == [("a", False, ([3], []), 4)]
    slots = sched.kv.coordinator.managers[1].pool
    assert slots.num_free_blocks == 1 and sched.kv.get_block_ids("b") == ([], [])
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert slots.num_free_blocks == 2 and sched.kv.pool.num_free_blocks == 3
    out, _ = step(sched, runner)
    # every block is new: the full queue is 2, then a's 3, 1; the slot queue 2, then a's 1
    assert cached(out) == [("b", True, ([2, 3, 1], [2]), 0)] and out.num_scheduled_tokens == {"b": 9}
    assert runner.reqs["b"]["blocks"] == [[2, 3, 1], [2]] and b.num_preemptions == 1


def test_request_events_with_log_events():
    sched = Scheduler(SchedulerConfig(8, 8, 256), KVCacheConfig([KVCacheGroupSpec(FULL, BS, [], [])], [64]),
                      log_events=True)
    runner = Runner()
    add(sched, "a", toks(10, 10), max_tokens=2)
    step(sched, runner)  # admitted: 8 of 10 prompt tokens
    assert [(e.step, e.attrs) for e in sched.drain_events()] == [
        (Step.KV_PREFIX_LOOKUP, dict(hit_tokens=0, hit_blocks=0, prompt_tokens=10, caching=True)),
        (Step.KV_ALLOCATE, dict(blocks=2)),
        (Step.SCHEDULER_CHUNK, dict(chunk=0, tokens=8, from_token=0, prompt_tokens=10, budget=8))]
    step(sched, runner)  # the last 2 prompt tokens: a second chunk, a third block
    assert [(e.step, e.attrs) for e in sched.drain_events()] == [
        (Step.SCHEDULER_CHUNK, dict(chunk=1, tokens=2, from_token=8, prompt_tokens=10, budget=8)),
        (Step.KV_ALLOCATE, dict(blocks=3))]
    step(sched, runner)  # a decode, then max_tokens 2 finishes it
    events = sched.drain_events()
    assert [(e.step, e.attrs) for e in events] == [
        (Step.KV_APPEND_SLOT, dict(blocks=3)),
        (Step.SCHEDULER_FINISH, dict(reason="length", output_tokens=2)),
        (Step.KV_FREE, dict(blocks=3, cached=True))]
    assert {e.request_id for e in events} == {"a"} and all(e.start <= e.end for e in events)
    assert sched.drain_events() == []


# -- speculative decoding: drafts in the budget, rollback, blocks given back ---------------

def test_drafts_scheduled_in_budget_rolled_back_and_never_cached():
    """Blocks of 4. A 6-token prompt samples t and drafts 5: the next step computes positions
    6..11 (3 blocks). The target accepts none and drafts 5 more: computed falls to 7 and the
    3 blocks stay, as the next step's 1 + 5 tokens need them (given back, the next step would
    take another block from the free queue's head and evict a cached one). Only block 0
    (verified) is cached. Two accepted and no drafts after: the block past the tokens goes
    back to the free queue's head, the next step hands the runner the cut tables whole, and
    the step after that takes that block again."""
    from lane.config import SpeculativeConfig

    sched = Scheduler(SchedulerConfig(64, 8, 256), KVCacheConfig([KVCacheGroupSpec(FULL, BS, [], [])], [16]),
                      eos_token_ids=[EOS], log_events=True,
                      speculative_config=SpeculativeConfig("ngram", 5))
    a = add(sched, "a", toks(10, 6))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6} and not out.scheduled_spec_decode_tokens
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[50]], spec_token_ids=[[51, 52, 53, 54, 55]]))
    assert a.spec_token_ids == [51, 52, 53, 54, 55] and a.num_computed_tokens == 6
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6} and out.scheduled_spec_decode_tokens == {"a": [51, 52, 53, 54, 55]}
    assert sched.kv.get_block_ids("a") == ([1, 2, 3],)
    sched.drain_events()
    outputs = sched.update_from_output(out, ModelRunnerOutput(["a"], [[60]], spec_token_ids=[toks(61, 5)]))
    assert outputs[0].new_token_ids == [60]
    assert a.all_token_ids == toks(10, 6) + [50, 60] and a.num_computed_tokens == 7
    assert sched.kv.get_block_ids("a") == ([1, 2, 3],)  # 8 tokens + 5 drafts: 4 blocks next step
    assert [sched.kv.pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, False, False]
    (rollback,) = [e for e in sched.drain_events() if e.step == Step.KV_ROLLBACK]
    assert rollback.attrs == dict(drafts=5, accepted=0, rejected=5, blocks_freed=0, computed_tokens=7)
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": toks(61, 5)}
    assert cached(out) == [("a", False, ([4],), 7)]
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[61, 62, 80]]))  # two accepted, no drafts
    assert a.all_token_ids[-4:] == [60, 61, 62, 80] and a.num_computed_tokens == 10
    assert sched.kv.get_block_ids("a") == ([1, 2, 3],) and list(sched.kv.pool.free_queue)[:2] == [4, 5]
    (rollback,) = [e for e in sched.drain_events() if e.step == Step.KV_ROLLBACK]
    assert rollback.attrs == dict(drafts=5, accepted=2, rejected=3, blocks_freed=1, computed_tokens=10)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.block_ids_replaced == [True]
    assert out.scheduled_cached_reqs.new_block_ids == [([1, 2, 3],)]  # the whole table
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[90]], spec_token_ids=[[91, 92]]))
    # partly accepted, within a budget that cuts the drafts: 1 pending + 1 of the 2 drafts
    sched.config.max_num_batched_tokens = 2
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 2} and out.scheduled_spec_decode_tokens == {"a": [91]}
    assert cached(out) == [("a", False, ([4],), 11)]  # block 4 again, from the queue's head
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[91, 100]]))
    assert a.all_token_ids[-3:] == [90, 91, 100] and a.num_computed_tokens == 13 and a.spec_token_ids == []
    s = sched.make_stats().spec_decoding
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 11, 3)
    assert s.num_accepted_tokens_per_pos == [2, 1, 0, 0, 0]
    # preemption drops the drafts
    a.spec_token_ids = [80, 81]
    sched._preempt(sched.running.pop())
    assert a.spec_token_ids == [] and a.num_computed_tokens == 0


def test_mtp_lookahead_slots_stop_at_max_model_len():
    """MTP k = 2 allocates 2 lookahead slots past each step's tokens, but none from
    max_model_len on (its drafts and writes stop there): a pool of exactly max_model_len's
    2 blocks of 4 serves a request growing to 8 tokens without preempting it (it preempted
    itself forever when its last step asked for 7 + 2 slots)."""
    from lane.config import SpeculativeConfig

    sched = Scheduler(SchedulerConfig(64, 8, 8), KVCacheConfig([KVCacheGroupSpec(FULL, BS, [], [])], [3]),
                      eos_token_ids=[EOS], speculative_config=SpeculativeConfig("mtp", 2))
    runner = Runner()
    a = add(sched, "a", toks(10, 5), ignore_eos=True)
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2],)  # 5 tokens + 2 lookahead slots
    for _ in range(5):
        if a.status.finished:
            break
        step(sched, runner)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_tokens == 8
    assert sched.num_preemptions == 0
