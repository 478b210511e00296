"""Speculative decoding in the engine (seed steps 45-48): drafts scheduled in the one token
budget, verified in one pass, rejected ones rolled back. In float32 and greedy it never
changes the output: n-gram on SmolLM2, MTP on tiny DeepSeek V3 / V3.2 / V4 (with chunked
prefill, prefix-cache hits and preemption); drafts that are partly right (an oracle drafter)
leave V4's compression state and entries as the run without drafts does; the MTP layers'
logits equal a transformers evaluation of the same block on the MTP weights."""
import os
import re

import pytest
import torch

from lane import LLM, SamplingParams
from lane.entrypoints.tiny_model import write_tiny_model
from conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
REPEAT = ("Copy this: the red fox ran to the old mill and back, the red fox ran to the old mill and back, "
          "the red fox ran to the old mill and back, the red fox")


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _ngram(k, lo=1, hi=3):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def _smollm(gguf, spec=None, **kw):
    args = dict(dtype="float32", quantization="none", kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                show_progress=False, speculative_config=spec)
    return LLM(gguf, **{**args, **kw})


@pytest.fixture(scope="module")
def smollm_baseline(lane_smollm_fp32):
    return _ids(lane_smollm_fp32.generate(PROMPTS + [REPEAT], GREEDY, use_tqdm=False))


@pytest.mark.parametrize("k,chunk", [(1, 2048), (3, 32), (5, 2048)])
def test_ngram_greedy_output_unchanged(smollm_gguf, smollm_baseline, k, chunk):
    """k drafts a step (with k=3 a 32-token budget: prompts in chunks, drafts cut to fit);
    accepted <= drafted, per-position acceptance non-increasing, most drafts accepted on
    the prompt that repeats itself."""
    llm = _smollm(smollm_gguf, _ngram(k), max_num_batched_tokens=chunk)
    outs = llm.generate(PROMPTS + [REPEAT], GREEDY, use_tqdm=False)
    assert _ids(outs) == smollm_baseline
    s = llm.engine.scheduler.make_stats().spec_decoding
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens <= k * s.num_drafts
    per_pos = s.num_accepted_tokens_per_pos
    assert len(per_pos) == k and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    llm.generate([REPEAT], GREEDY, use_tqdm=False)  # alone
    after = llm.engine.scheduler.make_stats().spec_decoding
    assert (after.num_accepted_tokens - s.num_accepted_tokens) / (after.num_draft_tokens - s.num_draft_tokens) > 0.5


def test_ngram_preemption_and_prefix_hits(smollm_gguf, smollm_baseline):
    """A pool too small for the batch (preemption drops drafts, recomputes), then the same
    prompts again (prefix hits): the same tokens; only verified tokens reach the cache."""
    # fp32 SmolLM2: 737,280 B per 16-token block
    llm = _smollm(smollm_gguf, _ngram(3), kv_cache_memory_bytes=12 * 737280, max_model_len=160)
    prompts = PROMPTS + [REPEAT]
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == smollm_baseline
    assert llm.engine.scheduler.num_preemptions > 0
    hits = llm.prefix_cache_stats.hits
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == smollm_baseline
    assert llm.prefix_cache_stats.hits > hits
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks  # every block given back


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    cache = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = write_tiny_model(arch, str(root / arch))
        return cache[arch]
    return get


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def _tiny(path, spec=None, **kw):
    args = dict(dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512, show_progress=False,
                speculative_config=spec)
    return LLM(path, **{**args, **kw})


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4"])
def test_mtp_greedy_output_unchanged(tiny, arch):
    """MTP k = 1 and 2 (k > layers: the layer runs again on its own output), 16-token
    prefill chunks, then the prompts again from the prefix cache."""
    path = tiny(arch)
    prompts = [{"prompt_token_ids": p} for p in _prompts((9, 40, 70))]
    base = _ids(_tiny(path, max_num_batched_tokens=16).generate(prompts, GREEDY, use_tqdm=False))
    for k in (1, 2):
        llm = _tiny(path, {"method": "mtp", "num_speculative_tokens": k}, max_num_batched_tokens=16)
        assert llm.engine.worker.model.num_mtp_layers == 1
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base, k
        hits = llm.prefix_cache_stats.hits
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base, k
        assert llm.prefix_cache_stats.hits > hits
        s = llm.engine.scheduler.make_stats().spec_decoding
        assert s.num_drafts > 0 and s.num_draft_tokens <= k * s.num_drafts
        assert s.num_accepted_tokens <= s.num_draft_tokens


class OracleDrafts:
    """A drafter for the test: the reference continuation with draft (call % 4) wrong, so
    steps in turn accept 0, 1, 2 and all 3 of their drafts (the verification is what is tested)."""

    def __init__(self, prompt: list[int], reference: list[int], k: int) -> None:
        self.prompt, self.reference, self.k = prompt, reference, k
        self.calls = 0

    def propose(self, token_ids: list[int]) -> list[int]:
        done = len(token_ids) - len(self.prompt)
        drafts = list(self.reference[done:done + self.k])
        self.calls += 1
        if self.calls % 4 < len(drafts):
            drafts[self.calls % 4] = (drafts[self.calls % 4] + 1) % 49152
        return drafts


def _request_cache(llm):
    """The last request's running state, entries and window, from its block tables (the
    runner still holds them: the finish reaches it with the next step)."""
    runner = llm.engine.worker.runner
    (st,) = runner.input_batch.requests.values()
    groups = runner.kv_cache_config.groups
    out = {}
    for name, t in runner.kv_caches.items():
        g = next(i for i, grp in enumerate(groups) if name in grp.layer_names)
        ids = st.block_ids[g]
        out[name] = t[[i for i in ids if i]] if groups[g].kind != "sliding_window" else t[ids[-1]]
    return st, out


def test_partly_accepted_drafts_roll_v4_state_back(tiny):
    """Drafts rejected at every position: the output, and V4's running compression state,
    compressed entries, indexer keys and window after it, equal the run without drafts."""
    path = tiny("deepseek_v4")
    prompt = _prompts((37,), seed=7)[0]
    sp = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)
    base = _tiny(path, enable_prefix_caching=False)
    ref = base.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    _, cache_ref = _request_cache(base)
    llm = _tiny(path, _ngram(3), enable_prefix_caching=False)
    oracle = OracleDrafts(prompt, ref, 3)
    llm.engine.worker.runner.ngram = oracle
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    s = llm.engine.scheduler.make_stats().spec_decoding
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert s.num_accepted_tokens_per_pos[0] > s.num_accepted_tokens_per_pos[2] > 0  # all-accepted steps too
    _, cache = _request_cache(llm)
    assert cache.keys() == cache_ref.keys() and any(n.endswith(".state") for n in cache)
    for name in cache:
        if name.endswith(("kv_cache", "entry_cache", "index_cache", "state")):
            torch.testing.assert_close(cache[name], cache_ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_mtp_logits_equal_transformers_block_on_mtp_weights(tiny, arch, tmp_path):
    """The MTP layer's logits over a prompt (its first pass, every position) against
    transformers: a model one layer deeper whose extra layer holds the MTP block's weights
    (model.layers.{N}.* for V3, mtp.0.* for V4), its input replaced by the MTP's mix of the
    main model's output and the next token's embedding, then the MTP's own head."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny(arch)
    prompt = _prompts((29,), seed=9)[0]
    llm = _tiny(path, {"method": "mtp", "num_speculative_tokens": 1}, enable_prefix_caching=False)
    model = llm.engine.worker.model
    seen = []
    forward = model.mtp_forward
    model.mtp_forward = lambda *a: seen.append(forward(*a)) or seen[-1]
    first = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    with torch.inference_mode():
        ours = model.mtp_logits(seen[0]).float()
    assert ours.shape[0] == len(prompt)

    cfg = AutoConfig.from_pretrained(path)
    N = cfg.num_hidden_layers
    tensors = load_file(os.path.join(path, "model.safetensors"))
    mtp = load_file(os.path.join(path, "model-mtp.safetensors"))
    prefix = f"model.layers.{N}." if arch == "deepseek_v3" else "mtp.0."
    extra = ("enorm", "hnorm", "eh_proj", "shared_head", "e_proj", "h_proj", "norm.", "hc_head", "embed_tokens")
    own = {k[len(prefix):]: v for k, v in mtp.items()}
    block = {k: v for k, v in own.items() if not k.startswith(extra)}
    tensors.update({f"model.layers.{N}.{k}": v for k, v in block.items()})
    cfg.num_hidden_layers = N + 1
    if arch == "deepseek_v4":
        cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
    d = tmp_path / "deeper"
    d.mkdir()
    cfg.save_pretrained(d)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    nxt = torch.tensor([prompt[1:] + [first]])

    def rms(x, w, eps=cfg.rms_norm_eps):
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    emb = hf.model.embed_tokens(nxt)
    captured = {}

    def mix(module, args, kwargs):
        x = args[0]
        if arch == "deepseek_v3":
            h = hf.model.norm(x)  # the main model's output: its final norm
            e = emb.clone()
            e[:, 0] = 0  # position 0 has no previous token
            x = torch.cat((rms(e, own["enorm.weight"]), rms(h, own["hnorm.weight"])), -1) @ own["eh_proj.weight"].T
        else:
            e = rms(emb, own["enorm.weight"]) @ own["e_proj.weight"].T
            x = e.unsqueeze(2) + rms(x, own["hnorm.weight"]) @ own["h_proj.weight"].T
        return (x, *args[1:]), kwargs

    hooks = [hf.model.layers[N].register_forward_pre_hook(mix, with_kwargs=True),
             hf.model.layers[N].register_forward_hook(lambda m, a, out: captured.setdefault("out", out))]
    with torch.inference_mode():
        hf(input_ids=ids)
        for h in hooks:
            h.remove()
        out = captured["out"]
        out = out[0] if isinstance(out, tuple) else out
        if arch == "deepseek_v3":
            ref = rms(out, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T
        else:
            from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

            head = DeepseekV4HyperHead(cfg)
            head.load_state_dict({"hc_fn": own["hc_head_fn"], "hc_base": own["hc_head_base"],
                                  "hc_scale": own["hc_head_scale"]})
            ref = rms(head(out), own["norm.weight"]) @ hf.lm_head.weight.T
    torch.testing.assert_close(ours, ref[0].float(), rtol=1e-3, atol=1e-3)


def test_cli_names_the_bad_flag(smollm_gguf):
    import subprocess
    import sys

    for cmd, spec, needle in (
            (["generate", "hi", "--quiet"], '{"method": "ngram", "num_speculative_tokens": 3', "is not JSON"),
            (["serve"], '{"method": "mtp"}', "method 'mtp' needs a model with MTP layers")):
        r = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", *cmd, "--speculative-config", spec],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert "--speculative-config" in r.stderr


def test_spec_config_refused_by_name(smollm_gguf, tiny, tmp_path):
    with pytest.raises(ValueError, match="needs a model with MTP layers.*LlamaForCausalLM"):
        _smollm(smollm_gguf, {"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="method 'eagle' is not one of ngram, mtp"):
        _smollm(smollm_gguf, {"method": "eagle", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="unknown key"):
        _smollm(smollm_gguf, {"method": "ngram", "num_speculative_tokens": 1, "draft_model": "x"})
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        _smollm(smollm_gguf, '{"method": "ngram"}')
    # a V3 checkpoint that says it has an MTP layer but carries none (as transformers saves it)
    import shutil

    d = tmp_path / "no-mtp"
    shutil.copytree(tiny("deepseek_v3"), d)
    os.remove(d / "model-mtp.safetensors")
    with pytest.raises(ValueError, match="no MTP weights"):
        _tiny(str(d), {"method": "mtp"})


def test_seeded_sampling_reproducible_with_drafts(smollm_gguf):
    """Random sampling with drafts (top-p and a repetition penalty on the target): a seeded
    request gives the same tokens twice, whatever else is in the batch."""
    llm = _smollm(smollm_gguf, _ngram(3))
    sp = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.05, max_tokens=32, seed=11,
                        ignore_eos=True)
    a = llm.generate([REPEAT], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([REPEAT, PROMPTS[0], PROMPTS[1]], [sp, SamplingParams(temperature=1.0, max_tokens=20),
                                                       SamplingParams(temperature=0, max_tokens=9)],
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 32
    assert llm.engine.scheduler.make_stats().spec_decoding.num_accepted_tokens > 0


def test_served_with_openai_client_metrics_log_trace_and_bench(tmp_path):
    """lane serve --speculative-config: the openai client's greedy answer equals the one without
    drafts; /metrics carries vLLM's spec_decode counters (accepted <= drafted, per position
    non-increasing, summing to the accepted); the log line reports them; the request's trace
    records steps 45-48 (not skipped); `lane bench` reads this run's acceptance from them."""
    import json
    import subprocess
    import sys
    import time

    import httpx2 as httpx

    from lane.tracing.client import fetch_trace
    from utils import RemoteServer, metric

    args = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory-bytes", "128M",
            "--max-model-len", "1024", "--trace"]
    answers = []
    for spec in (None, _ngram(3)):  # with drafts over two data-parallel replicas
        with RemoteServer(args + (["--speculative-config", json.dumps(spec), "-dp", "2"] if spec else [])) as s:
            c = s.client()
            model = c.models.list().data[0].id
            r = c.completions.create(model=model, prompt=REPEAT, max_tokens=40, temperature=0)
            answers.append(r.choices[0].text)
            if spec is None:
                continue
            text = httpx.get(s.url + "/metrics").text
            drafts = metric(text, "vllm:spec_decode_num_drafts_total")
            drafted = metric(text, "vllm:spec_decode_num_draft_tokens_total")
            accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
            per_pos = [metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                       for i in range(3)]
            assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
            assert per_pos[0] >= per_pos[1] >= per_pos[2] and sum(per_pos) == accepted
            assert accepted / drafted > 0.5
            spans = fetch_trace(s.url, r.id, {})["spans"]
            recorded = {sp["step"] for sp in spans if not sp.get("skipped")}
            skipped = {sp["step"] for sp in spans if sp.get("skipped")}
            assert {45, 46, 47, 48} <= recorded and not {45, 46, 47, 48} & skipped
            assert sum(sp["attrs"]["accepted"] for sp in spans if sp["step"] == 47) == accepted
            rollback = [sp["attrs"] for sp in spans if sp["step"] == 48]
            assert rollback and all(a["rejected"] == a["drafts"] - a["accepted"] for a in rollback)
            deadline = time.monotonic() + 15
            while "SpecDecoding metrics" not in s.read_log() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert re.search(r"SpecDecoding metrics: Mean acceptance length: \d+\.\d\d", s.read_log())
            out = tmp_path / "bench"
            # the repeating prompt, so n-gram drafts are found (random tokens may give none)
            dataset = tmp_path / "repeat.jsonl"
            dataset.write_text(4 * (json.dumps({"prompt": REPEAT, "max_tokens": 16}) + "\n"))
            b = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "bench", "--base-url", s.url,
                                "--dataset-name", "jsonl", "--dataset-path", str(dataset), "--num-prompts", "4",
                                "--ignore-eos", "--result-dir", str(out)],
                               capture_output=True, text=True, timeout=300)
            assert b.returncode == 0, b.stderr
            summary = json.loads((out / "summary.json").read_text())
            assert summary["spec_decode_num_drafts"] > 0
            after = httpx.get(s.url + "/metrics").text
            assert summary["spec_decode_num_drafts"] == metric(after, "vllm:spec_decode_num_drafts_total") - drafts
            assert summary["spec_decode_accepted_tokens"] == (
                metric(after, "vllm:spec_decode_num_accepted_tokens_total") - accepted)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_mtp_under_forced_preemption(tiny, arch):
    """Pools too small for the three requests at once (MLA's latent pool; V4's window pool):
    requests are preempted, their drafts dropped, everything recomputed (the MTP layer's
    cache too): the tokens of the run without drafts."""
    from lane.core.kv_cache_utils import window_blocks_needed

    path, spec = tiny(arch), {"method": "mtp", "num_speculative_tokens": 2}
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, enable_prefix_caching=False)
    pages = [g.page_size_bytes for g in _tiny(path, spec, **kw).engine.kv_cache_config.groups]
    if arch == "deepseek_v3":
        budget = 10 * pages[0]  # 9 blocks of 16 tokens: one request fits, three do not
    else:
        budget = 12 * pages[0] + window_blocks_needed(16, 16, 4, 16)[1] * pages[1] + 5 * pages[2]
    prompts = [{"prompt_token_ids": p} for p in _prompts((9, 40, 70), seed=3)]
    base = _tiny(path, **kw)
    want = _ids(base.generate(prompts, GREEDY, use_tqdm=False))
    llm = _tiny(path, spec, kv_cache_memory_bytes=budget, **kw)
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_logprobs_of_accepted_drafts_equal_without(smollm_gguf, lane_smollm_fp32):
    """Each accepted draft's logprob (and top-N) is the target's at its position, as without
    drafts."""
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    want = lane_smollm_fp32.generate([REPEAT], sp, use_tqdm=False)[0].outputs[0]
    llm = _smollm(smollm_gguf, _ngram(3))
    got = llm.generate([REPEAT], sp, use_tqdm=False)[0].outputs[0]
    assert llm.engine.scheduler.make_stats().spec_decoding.num_accepted_tokens > 5
    assert got.token_ids == want.token_ids and len(got.logprobs) == 24
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-4
    assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-3


def test_rejected_drafts_evict_no_cached_blocks(tiny):
    """A 12-block pool (11 usable) with prefix caching: an 80-token prompt leaves 5 cached
    blocks, then another request decodes 50 tokens in the 6 blocks left, with MTP k = 2 whose
    drafts the target rejects. It evicts no more cached blocks than the run without drafts
    (none), so the first prompt hits as much of the cache again. (Before: each rejection gave
    back the block of the drafts' and lookahead slots, the next step took another from the
    head of the free queue, a cached block; 5 evictions, no hit left.)"""
    path, spec = tiny("deepseek_v3"), {"method": "mtp", "num_speculative_tokens": 2}
    first, second = [{"prompt_token_ids": p} for p in _prompts((80, 20), seed=5)]
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    evictions, rehits, outs = [], [], []
    for s in (None, spec):
        page = _tiny(path, s).engine.kv_cache_config.groups[0].page_size_bytes  # MTP adds its layer's cache
        llm = _tiny(path, s, kv_cache_memory_bytes=12 * page, max_model_len=128)
        assert llm.engine.kv_cache_config.num_blocks == [12]
        llm.generate([first], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        pool = llm.engine.scheduler.kv.pool
        assert len(pool.cached) == 5 and pool.num_evictions == 0
        outs.append(_ids(llm.generate([second], sp, use_tqdm=False)))
        evictions.append(pool.num_evictions)
        hits = llm.prefix_cache_stats.hits
        llm.generate([first], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        rehits.append(llm.prefix_cache_stats.hits - hits)
    st = llm.engine.scheduler.make_stats().spec_decoding
    assert st.num_draft_tokens > 40 and st.num_accepted_tokens < st.num_draft_tokens  # rejections
    assert outs[1] == outs[0]
    assert evictions[1] <= evictions[0] and rehits[1] == rehits[0] == 64, (evictions, rehits)


def test_mtp_request_reaching_max_model_len_in_the_least_pool(tiny):
    """The least budget the sizing error suggests for max_model_len 64, MTP k = 2: one request
    grows to max_model_len and finishes (before: the allocation for its last tokens plus the
    2 lookahead slots needed a block the pool lacks, and it preempted itself forever)."""
    path, spec = tiny("deepseek_v3"), {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="at least") as e:
        _tiny(path, spec, kv_cache_memory_bytes=1024, max_model_len=64)
    least = int(re.search(r"to at least (\d+)", str(e.value)).group(1))
    llm = _tiny(path, spec, kv_cache_memory_bytes=least, max_model_len=64)
    assert llm.engine.kv_cache_config.num_blocks == [5]  # 4 blocks of 16 tokens + the null block
    prompt = _prompts((10,), seed=2)[0]
    base = _tiny(path, max_model_len=64).generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    rid = llm._add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=100,
                                                                       ignore_eos=True))
    done = []
    for _ in range(200):  # bounded: the bug never finishes
        done += [o for o in llm._step() if o.request_id == rid and o.finished]
        if done:
            break
    assert done, f"not finished after 200 steps ({llm.engine.scheduler.num_preemptions} preemptions)"
    out = done[0].outputs[0]
    assert len(out.token_ids) == 54 and out.finish_reason == "length" and out.token_ids == base.token_ids
    assert llm.engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_mtp_draft_checkpoint_drafts_as_the_targets_own_layers(tmp_path, arch):
    """The MTP layers split off into a draft checkpoint (DeepSeekMTPModel / DeepSeekV4MTPModel,
    the target keeping none) and named in --speculative-config: the same drafts, acceptances
    and tokens as the target's own MTP layers (which equal no speculation's: above)."""
    from lane.entrypoints.tiny_model import split_mtp_draft

    whole = write_tiny_model(arch, str(tmp_path / "whole"))
    target = write_tiny_model(arch, str(tmp_path / "target"))
    draft = split_mtp_draft(target, str(tmp_path / "draft"))
    prompts = [{"prompt_token_ids": p} for p in _prompts((9, 40))]

    def run(path, spec=None):
        llm = _tiny(path, spec, max_num_batched_tokens=16)
        try:
            out = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
            s = llm.engine.scheduler.make_stats().spec_decoding if spec else None
            return out, s and (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        finally:
            llm.shutdown()

    own = run(whole, {"method": "mtp", "num_speculative_tokens": 2})
    drafted = run(target, {"method": "mtp", "num_speculative_tokens": 2, "model": draft})
    assert drafted == own and own[1][0] > 0


def test_draft_checkpoints_and_known_architectures_are_refused_by_name(tiny, tmp_path):
    """A draft checkpoint served as a model, a draft for another target, 'model' with n-gram
    drafting, and the seed's Qwen3DSparkModel (known, no reference) are refused with the reason;
    lane explain says what each is."""
    import json

    from lane.entrypoints.explain import explain
    from lane.entrypoints.tiny_model import split_mtp_draft

    v4 = write_tiny_model("deepseek_v4", str(tmp_path / "v4"))
    v4_draft = split_mtp_draft(v4, str(tmp_path / "v4-draft"))
    with pytest.raises(ValueError, match="DeepSeekV4MTPModel is a draft model"):
        _tiny(v4_draft)
    assert "a draft checkpoint (MTP layers) for DeepseekV4ForCausalLM" in explain(v4_draft)
    with pytest.raises(ValueError, match=r"do not draft for DeepseekV3ForCausalLM"):
        _tiny(tiny("deepseek_v3"), {"method": "mtp", "model": v4_draft})
    with pytest.raises(ValueError, match="'model' names an MTP draft checkpoint"):
        _tiny(tiny("deepseek_v3"), {"method": "ngram", "num_speculative_tokens": 2, "model": v4_draft})
    dspark = tmp_path / "dspark"
    dspark.mkdir()
    cfg = json.loads((tmp_path / "v4" / "config.json").read_text())
    (dspark / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3DSparkModel"]}))
    with pytest.raises(ValueError, match="Qwen3DSparkModel is known and not supported: .*no public reference"):
        _tiny(str(dspark))
    assert "Qwen3DSparkModel is known (the seed's registry lists it) and refused" in explain(str(dspark))
