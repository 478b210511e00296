"""EPLB (seed steps 7, 53, 54): DeepSeek's rebalancing, the expert maps and the replica choice,
the weight moves' plan; then real engines: in-process at one rank (redundant slots, local
copies), over two ranks with gloo point-to-point moves (float32 greedy tokens equal one rank
without EPLB; moved weights equal the checkpoint's, quantized ones with their scales), a skewed
router that a rearrangement balances, a server moving experts under 16 streams, and a rank
killed mid-move."""
import json
import os
import re
import time

import httpx2 as httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from lane import LLM, SamplingParams
from lane.entrypoints.cli import main as lane_main
from lane.entrypoints.tiny_model import write_tiny_model
from lane.eplb.mover import plan_layer
from lane.eplb.placement import (ExpertMap, balancedness, expected_physical_load, initial_phy2log, keep_in_place,
                                 logical_maps, rank_loads)
from lane.eplb.rebalance import rebalance_experts
from lane.tracing import Step, tracer
from utils import RemoteServer

FP32 = dict(dtype="float32", show_progress=False)
# a long prompt (chunked at 16 tokens a step), two sharing 24 tokens (a prefix hit), and enough
# output that the small pool preempts
PROMPTS = [list(range(100, 148)), list(range(200, 224)) + [5, 6, 7], list(range(200, 224)) + [9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# the MoE checkpoints' expert tensor names: (layer, expert, projection) from either family
_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|ffn)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


def _tokens(llm: LLM) -> list[list[int]]:
    """The first two prompts together, then the third (its first block is then a cache hit)."""
    return [o.outputs[0].token_ids for batch in (PROMPTS[:2], PROMPTS[2:])
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)]


# per architecture, a pool of 5 usable blocks a rank: the two first prompts fit, then grow into a
# preemption (a machine's ranks split the budget: x tp)
POOL_KIB = {"deepseek_v3": 48, "skewed_v3": 48, "deepseek_v32": 84, "deepseek_v4": 58}


def _kw(arch: str, tp: int = 1, **eplb) -> dict:
    # chunked prefill at 16 tokens a step and a pool small enough to preempt
    kw = dict(FP32, max_num_batched_tokens=16, max_model_len=64, kv_cache_memory_bytes=(tp * POOL_KIB[arch]) << 10,
              tensor_parallel_size=tp)
    if eplb:
        kw.update(enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb)
    return kw


def _tracing_off() -> None:
    tracer.enabled, tracer.rank = False, None
    tracer.drain()


def _skew(model_dir: str, hot: tuple[int, ...]) -> str:
    """Give ``hot`` experts a large routing bias in every MoE layer: the router favours them."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            t.zero_()
            t[list(hot)] = 5.0
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-eplb")
    out = {arch: write_tiny_model(arch, str(root / arch)) for arch in ("deepseek_v3", "deepseek_v32", "deepseek_v4")}
    # experts 2 and 3 (both in rank 0's initial slots) take nearly every token
    out["skewed_v3"] = _skew(write_tiny_model("deepseek_v3", str(root / "skewed")), (2, 3))
    return out


@pytest.fixture(scope="module")
def reference(tiny):
    """One rank, no EPLB: the tokens every EPLB run must give."""
    out = {}
    for arch in ("deepseek_v3", "deepseek_v32", "deepseek_v4"):
        ref = LLM(tiny[arch], **_kw(arch))
        out[arch] = _tokens(ref)
        ref.shutdown()
    return out


# -- the algorithm, the maps, the plan -------------------------------------------------------

def test_rebalance_replicates_the_hottest_and_evens_the_ranks():
    load = torch.tensor([[90, 80, 10, 10, 5, 5, 0, 0], [1, 1, 1, 1, 1, 1, 1, 100]])
    start = initial_phy2log(2, 8, 12)
    before = balancedness(rank_loads(expected_physical_load(load, start, logical_maps(start, 8)[1]), 4))
    for groups in (1, 2):
        phy2log, count = rebalance_experts(load, 12, groups, 1, 4)
        assert phy2log.shape == (2, 12)
        for layer in range(2):  # every logical expert somewhere; the redundant slots to the hottest
            assert sorted(set(phy2log[layer].tolist())) == list(range(8))
        assert count[0].tolist()[:2] == [3, 3] and count[1, 7] == 5
        assert torch.equal(count, logical_maps(phy2log, 8)[1])
        after = balancedness(rank_loads(expected_physical_load(load, phy2log, count), 4))
        assert (after > before).all(), (before, after)
        assert after[0] > 0.85 and after[1] > 0.6


def test_hierarchical_packs_whole_groups_onto_nodes():
    load = torch.tensor([[50, 40, 30, 20, 4, 3, 2, 1]]).float()
    phy2log, count = rebalance_experts(load, 8, 4, 2, 4)  # 4 groups of 2 experts, 2 nodes of 2 ranks
    node_experts = [set(phy2log[0, :4].tolist()), set(phy2log[0, 4:].tolist())]
    groups = [{2 * g, 2 * g + 1} for g in range(4)]
    for experts in node_experts:  # a node holds whole groups: 2 of them
        assert sum(g <= experts for g in groups) == 2
    assert count.sum() == 8


def test_maps_and_the_replica_choice_spread_tokens_over_every_replica():
    phy2log = initial_phy2log(1, 4, 7)  # experts 0, 1, 2 have two slots each
    assert phy2log[0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    log2phy, count = logical_maps(phy2log, 4)
    assert count[0].tolist() == [2, 2, 2, 1]
    assert log2phy[0].tolist() == [[0, 4, -1, -1], [1, 5, -1, -1], [2, 6, -1, -1], [3, -1, -1, -1]]  # [E, R + 1]
    m = ExpertMap(phy2log[0], log2phy[0], count[0])
    ids = torch.tensor([[0, 1], [0, 3], [2, 0], [0, 1], [1, 2]])
    phys = m.to_physical(ids)
    assert torch.equal(phy2log[0][phys], ids)  # every choice is a replica of the chosen expert
    assert torch.equal(m.to_physical(ids), phys)  # a pure function of the batch
    served = set(phys.flatten().tolist())
    assert {0, 4, 1, 5, 2, 6} <= served  # both replicas of 0, 1 and 2 served tokens
    assert phys[1, 1] == 3


def test_slots_that_keep_their_expert_stay_and_the_plan_moves_the_rest():
    old = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    new = torch.tensor([[7, 0, 5, 1, 2, 3, 4, 6]])  # rank 0: {7, 0, 5, 1}, rank 1: {2, 3, 4, 6}
    kept = keep_in_place(old, new, 2)
    # 0, 1 (rank 0) and 4, 6 (rank 1) stay in their slots; the new experts fill the others in order
    assert kept[0].tolist() == [0, 1, 7, 5, 4, 2, 6, 3]
    plan = plan_layer(old[0].tolist(), kept[0].tolist(), 2)
    # rank 0 needs 5 and 7 from rank 1; rank 1 needs 2 and 3 from rank 0; nothing local
    assert sorted((e, src, dst) for e, src, _, dst in plan.transfers) == [(2, 0, 1), (3, 0, 1), (5, 1, 0), (7, 1, 0)]
    assert not plan.local_copies
    same = plan_layer([0, 1, 2, 0], [1, 0, 2, 2], 1)
    assert sorted(same.local_copies) == [(0, 0, 1), (0, 1, 0), (0, 3, 2)] and not same.transfers


# -- flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--enable-eplb"], "--enable-eplb balances whole experts over the expert-parallel ranks: it requires "
                        "--enable-expert-parallel"),
    (["--enable-expert-parallel", "--enable-eplb", "--eplb-config", '{"window": 3}'],
     "--eplb-config: unknown key(s) window"),
    (["--enable-expert-parallel", "--enable-eplb", "--eplb-config", '{"step_interval": 0}'],
     "--eplb-config step_interval must be an integer >= 1, got 0"),
    (["--enable-expert-parallel", "--enable-eplb", "--eplb-config", '{"use_async": "yes"}'],
     "--eplb-config use_async must be true or false"),
    (["--enable-expert-parallel", "--enable-eplb", "--eplb-config", "{bad"], "--eplb-config is not JSON"),
    (["--enable-expert-parallel", "--eplb-config", '{"num_redundant_experts": 2}'],
     "num_redundant_experts needs --enable-eplb"),
    (["-tp", "2", "--enable-expert-parallel", "--enable-eplb", "--eplb-config", '{"num_redundant_experts": 1}'],
     "num_experts 8 + num_redundant_experts 1 = 9 physical experts do not divide over the 2 expert-parallel "
     "ranks; set num_redundant_experts in --eplb-config to 0 (or 0 plus a multiple of 2)"),
])
def test_bad_eplb_flags_are_refused_by_name(tiny, capsys, args, needle):
    # no --quiet: in this process it would set LANE_LOGGING_LEVEL for every process started after
    with pytest.raises(SystemExit) as e:
        lane_main(["generate", "hi", "--model", tiny["deepseek_v4"], *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_explain_shows_the_initial_placement(tiny, capsys):
    assert lane_main(["explain", tiny["deepseek_v4"], "-tp", "2", "--enable-expert-parallel", "--enable-eplb",
                      "--eplb-config", '{"num_redundant_experts": 2, "step_interval": 600}']) == 0
    out = capsys.readouterr().out
    assert "rank 0: query heads 0-1" in out and "slots 0-4 holding experts [0, 1, 2, 3, 4]" in out
    assert "rank 1: query heads 2-3" in out and "slots 5-9 holding experts [5, 6, 7, 0, 1]" in out
    assert "8 logical experts in 10 physical slots per MoE layer (2 redundant)" in out
    assert "a rearrangement every 600 steps" in out


# -- engines --------------------------------------------------------------------------------

def test_one_rank_with_redundant_slots_and_local_moves_keeps_the_tokens(tiny, reference):
    """At one rank EPLB still replicates and re-places: replicas are local copies. Sync and
    async, a rearrangement every 4 steps, prefix hit and preemption in the same run."""
    for use_async in (False, True):
        tracer.enable()
        try:
            llm = LLM(tiny["deepseek_v4"], **_kw("deepseek_v4", num_redundant_experts=3, step_interval=4,
                                                 window_size=3, use_async=use_async))
            assert _tokens(llm) == reference["deepseek_v4"]
            sched = llm.engine.scheduler
            assert sched.kv.stats.hits > 0 and sched.num_preemptions > 0
            stats = llm.engine.eplb_stats
            assert stats.rebalance_events >= 3 and stats.rearrangement_seconds
            moves = [s for s in tracer.drain() if s.step == Step.EPLB_REBALANCE]
            assert moves and sum(s.attrs["local_copies"] for s in moves) > 0
            assert all(s.attrs.get("experts_moved", 0) == 0 for s in moves)  # one rank: nothing to send
            state = llm.engine.worker.eplb
            assert state.phy2log.shape == (4, 11)  # V4's 4 MoE layers (the hash layer too), 8 + 3 slots
            _assert_slots_hold_their_experts(llm, tiny["deepseek_v4"])
        finally:
            _tracing_off()
        llm.shutdown()


def _checkpoint_experts(model_dir: str) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    out: dict = {}
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors"):
            for name, t in load_file(os.path.join(model_dir, f)).items():
                if m := _EXPERT.search(name):
                    proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(3), m.group(3))
                    out.setdefault((int(m.group(1)), int(m.group(2))), {})[proj] = t
    return out


def _assert_slots_hold_their_experts(llm: LLM, model_dir: str, reference_slots=None) -> None:
    """Every rank's every slot holds its logical expert's weights, bit for bit: the checkpoint's
    (float32), or (quantized) the one-rank load's slot of that expert, scales and sums included."""
    per_rank = llm.engine.executor.collective_rpc("expert_slots")
    checkpoint = _checkpoint_experts(model_dir) if reference_slots is None else None
    checked = 0
    for slots in per_rank:
        for layer, (experts, tensors) in slots.items():
            for s, e in enumerate(experts):
                if reference_slots is not None:
                    _, ref = reference_slots[layer]
                    for t, r in zip(tensors, ref):
                        assert torch.equal(t[s], r[e]), (layer, s, e)
                else:
                    w = checkpoint[(layer, e)]
                    assert torch.equal(tensors[0][s], torch.cat((w["gate_proj"], w["up_proj"])).float()), (layer, s, e)
                    assert torch.equal(tensors[1][s], w["down_proj"].float()), (layer, s, e)
                checked += 1
    assert checked >= 2 * len(per_rank)


@pytest.mark.parametrize("arch,eplb", [
    ("deepseek_v4", dict(num_redundant_experts=2, step_interval=5, window_size=4)),
    ("deepseek_v4", dict(step_interval=5, window_size=8, use_async=True)),
    ("deepseek_v3", dict(num_redundant_experts=2, step_interval=4, window_size=4, use_async=True)),
    ("deepseek_v32", dict(num_redundant_experts=4, step_interval=4, window_size=4, use_async=True)),
])
def test_two_ranks_moving_experts_mid_generation_equal_one_rank(tiny, reference, arch, eplb):
    """TP=2 + EP + EPLB, rearrangements forced mid-generation (every few steps), weights sent
    between the ranks: greedy tokens equal one rank's without EPLB, with chunked prefill, a prefix
    hit and a preemption in the same run; after, every slot holds its expert's weights."""
    tracer.enable()
    try:
        llm = LLM(tiny[arch], **_kw(arch, 2, **eplb))
        try:
            assert _tokens(llm) == reference[arch]
            sched = llm.engine.scheduler
            assert sched.kv.stats.hits > 0 and sched.num_preemptions > 0
            spans = tracer.drain()
            stats = llm.engine.eplb_stats
            assert stats.rebalance_events >= 3 and stats.moved_bytes > 0
            moved = [s for s in spans if s.step == Step.EPLB_REBALANCE]
            assert sum(s.attrs["experts_moved"] for s in moved) > 0
            assert {s.attrs["rank"] for s in moved} == {0, 1}
            placement = [s for s in spans if s.step == Step.EPLB_INITIAL_PLACEMENT]
            assert len(placement) == 2 and placement[0].attrs["redundant"] == eplb.get("num_redundant_experts", 0)
            _assert_slots_hold_their_experts(llm, tiny[arch])
        finally:
            llm.shutdown()
    finally:
        _tracing_off()


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_quantized_experts_move_with_their_scales(tiny, quantization):
    """int8 / w8a8 experts: after rearrangements over two ranks, every slot's int8 weights, scales
    (and w8a8's sums) equal the one-rank load's for its expert."""
    ref = LLM(tiny["skewed_v3"], quantization=quantization, **_kw("skewed_v3"))
    want = ref.engine.worker.expert_slots()
    ref.shutdown()
    llm = LLM(tiny["skewed_v3"], quantization=quantization,
              **_kw("skewed_v3", 2, num_redundant_experts=2, step_interval=3, window_size=3))
    try:
        _tokens(llm)
        assert llm.engine.eplb_stats.moved_bytes > 0
        _assert_slots_hold_their_experts(llm, tiny["skewed_v3"], reference_slots=want)
    finally:
        llm.shutdown()


def test_a_skewed_router_is_balanced_by_one_rearrangement(tiny):
    """Experts 2 and 3 take nearly every token and start on rank 0 only. The heat window sums to
    the tokens routed; after one rearrangement the measured balancedness rises."""
    tracer.enable()
    try:
        llm = LLM(tiny["skewed_v3"], **dict(_kw("skewed_v3", 2, num_redundant_experts=2, step_interval=12,
                                                window_size=12), kv_cache_memory_bytes=4 << 20, max_model_len=256))
        try:
            prompts = [list(range(300 + 7 * i, 340 + 7 * i)) for i in range(2)]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
            # 80 prompt tokens over 5 steps of 16, then 2 decode steps of 2 rows: 7 steps, no collection yet
            forwarded = sum(len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outs))
            window = llm.engine.executor.collective_rpc("eplb_window_load")  # each rank's slots
            per_layer = torch.stack(window).sum(0).sum(-1)
            assert per_layer.tolist() == [forwarded * 2] * 2  # top-2 of every forwarded token, each MoE layer
            # 240 prompt tokens (15 steps) and 8 tokens each: past step 24, the second collection
            llm.generate([{"prompt_token_ids": list(range(500 + 60 * i, 560 + 60 * i))} for i in range(4)],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            collects = [s for s in tracer.drain() if s.step == Step.EPLB_COLLECT and s.attrs["rank"] == 0]
            assert len(collects) >= 2
            first, second = collects[0].attrs["balancedness_min"], collects[1].attrs["balancedness_min"]
            assert first < 0.6 < second, (first, second)
        finally:
            llm.shutdown()
    finally:
        _tracing_off()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_serve_moves_experts_under_16_streams_and_each_equals_its_solo_run(tiny):
    eplb = {"num_redundant_experts": 2, "step_interval": 6, "window_size": 6, "use_async": True,
            "log_balancedness": True, "log_balancedness_interval": 5}
    prompts = [[1000 + 37 * i + j for j in range(8 + i % 5)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(tiny["deepseek_v4"], **FP32)
    want = [ref.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    ref.shutdown()
    with RemoteServer(["--model", tiny["deepseek_v4"], "--dtype", "float32", "-tp", "2", "--enable-expert-parallel",
                       "--enable-eplb", "--eplb-config", json.dumps(eplb), "--max-num-batched-tokens", "32",
                       "--trace"]) as s:
        import concurrent.futures

        client = s.client(timeout=120)
        model = client.models.list().data[0].id

        def one(p):
            r = client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            chunks = list(r)
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[0].id

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(one, prompts))
        assert [text for text, _ in got] == want
        # every trace: step 7 from both ranks at start-up; 53 and 54 recorded where they ran while the
        # request did, else skipped saying so
        ran = set()
        for _, rid in got:
            spans = httpx.get(f"{s.url}/v1/traces/{rid}").json()["spans"]
            assert {sp["attrs"].get("rank") for sp in spans if sp["step"] == 7 and not sp.get("skipped")} == {0, 1}
            for step in (53, 54):
                mine = [sp for sp in spans if sp["step"] == step]
                assert mine and (all(not sp.get("skipped") for sp in mine)
                                 or "none while this request ran" in mine[0]["skipped"])
                ran |= {step for sp in mine if not sp.get("skipped")}
        assert ran == {53, 54}
        metrics = httpx.get(s.url + "/metrics").text
        assert _metric(metrics, "vllm:eplb_rebalance_events_total") >= 2
        assert _metric(metrics, "lane:eplb_moved_bytes_total") > 0
        assert _metric(metrics, "lane:eplb_rearrangement_seconds_count") >= 1
        assert 0 < _metric(metrics, "vllm:eplb_balancedness_min") <= 1
        assert "vllm:eplb_rebalancing{" in metrics
        log = s.read_log()
        assert "EPLB step: avg_tokens=" in log and "balancedness=" in log
        assert "EPLB rearrangement 1:" in log


def test_a_rank_killed_mid_move_fails_the_engine(tiny):
    """Rank 1 SIGKILLs itself after receiving its first moved layer, before copying it into place:
    the request fails and /health turns 503 within 5 s (no hang)."""
    eplb = {"num_redundant_experts": 2, "step_interval": 3, "window_size": 3}
    with RemoteServer(["--model", tiny["skewed_v3"], "--dtype", "float32", "-tp", "2", "--enable-expert-parallel",
                       "--enable-eplb", "--eplb-config", json.dumps(eplb), "--max-num-batched-tokens", "16"],
                      env={"LANE_FAULT_INJECT": "eplb_move:1"}) as s:
        client = s.client(timeout=60)
        model = client.models.list().data[0].id
        t0 = time.monotonic()
        with pytest.raises(Exception):
            client.completions.create(model=model, prompt=list(range(100, 160)), max_tokens=20,
                                      extra_body={"ignore_eos": True})
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() - t0 < 5
            time.sleep(0.1)
        assert "exited with code -9" in s.read_log()
