"""The scheduling policies (SchedulerConfig.policy): decode-first, vLLM's order, and
prefill-first, which gives the step's budget to prompts and the running decodes what is left.
Model-free, on test_core_scheduler's stand-in runner; then the same greedy tokens either way
on the real model."""
from __future__ import annotations

import pytest

from lane import SamplingParams
from lane.config import SchedulerConfig
from test_core_scheduler import Runner, add, make_scheduler, step, toks


def prefill_first(**kw):
    sched = make_scheduler(**kw)
    sched.config.policy = "prefill-first"
    return sched


def test_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling policy 'fifo'"):
        SchedulerConfig(policy="fifo")


def test_prompts_take_the_budget_and_decodes_the_rest():
    sched, runner = prefill_first(budget=10), Runner()
    add(sched, "a", toks(10, 4))
    add(sched, "b", toks(20, 4))
    out, _ = step(sched, runner)  # a and b prefilled: both decode from now on
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    for rid, start in (("c", 30), ("d", 40), ("e", 50)):
        add(sched, rid, toks(start, 6))
    out, _ = step(sched, runner)  # the prompts first: c whole, d's first 4 tokens, no decode
    assert out.num_scheduled_tokens == {"c": 6, "d": 4}
    out, _ = step(sched, runner)  # d's rest, e whole, then the decodes in the 2 tokens left
    assert list(out.num_scheduled_tokens.items()) == [("d", 2), ("e", 6), ("a", 1), ("b", 1)]
    out, _ = step(sched, runner)  # nobody waiting: everyone decodes
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}


def test_decode_first_gives_the_same_steps_to_the_decodes_first():
    sched, runner = make_scheduler(budget=10), Runner()
    add(sched, "a", toks(10, 4))
    add(sched, "b", toks(20, 4))
    step(sched, runner)
    for rid, start in (("c", 30), ("d", 40), ("e", 50)):
        add(sched, rid, toks(start, 6))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6, "d": 2}


def test_a_budget_the_prompts_leave_goes_to_the_decodes():
    sched, runner = prefill_first(budget=16), Runner()
    add(sched, "a", toks(10, 4))
    step(sched, runner)
    add(sched, "b", toks(20, 6))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 6, "a": 1}


def test_no_room_to_admit_means_decodes_as_usual():
    sched, runner = prefill_first(budget=10, max_num_seqs=2), Runner()
    add(sched, "a", toks(10, 4))
    add(sched, "b", toks(20, 4))
    step(sched, runner)
    add(sched, "c", toks(30, 6))  # max_num_seqs reached: c cannot be admitted, nobody waits for it
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_prompt_without_blocks_does_not_stop_the_decodes():
    # 8 usable blocks of 4 tokens: a and b hold 2 each; c (20 tokens, 5 blocks) cannot have them
    sched, runner = prefill_first(num_blocks=9, budget=32), Runner()
    add(sched, "a", toks(10, 6))
    add(sched, "b", toks(20, 6))
    step(sched, runner)
    add(sched, "c", toks(30, 20))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_nothing_schedulable_falls_back_to_preempting():
    # every block held by the running requests, none for their next tokens without preempting
    sched, runner = prefill_first(num_blocks=5, budget=32), Runner()
    add(sched, "a", toks(10, 8))  # 2 blocks, full
    add(sched, "b", toks(20, 8))  # 2 blocks, full
    step(sched, runner)
    add(sched, "c", toks(30, 4))
    out, _ = step(sched, runner)  # decode-first's loop: b preempted for a's block
    assert out.preempted_req_ids == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert sched.config.policy == "prefill-first"


def test_greedy_tokens_do_not_depend_on_the_policy(lane_smollm_fp32):
    llm = lane_smollm_fp32
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 100 + 7 * i + 20 + 9 * i))} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = llm.engine.scheduler.config
    before = (config.policy, config.max_num_batched_tokens)
    got = {}
    try:
        for policy in ("decode-first", "prefill-first"):
            config.policy, config.max_num_batched_tokens = policy, 24  # chunks, and prompts over several steps
            got[policy] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        config.policy, config.max_num_batched_tokens = before
    assert got["decode-first"] == got["prefill-first"]
