"""DeepSeek V4 on the tiny config of DEEPSEEK_V4.md §6 (SmolLM2's vocabulary): logits
and greedy tokens against transformers, through chunked prefill, mixed batches, a
prefix-cache hit and preemption; the cache's accounting."""
import pytest
import torch

from lane import LLM, SamplingParams
from lane.entrypoints.explain import explain
from lane.entrypoints.tiny_model import write_tiny_model
from conftest import assert_logprobs_match_hf, hf_greedy, traced_spans

LENGTHS = (1, 3, 4, 15, 16, 17, 63, 64, 200)  # windows (16), CSA (4) and HCA (16) edges, top-8 selection


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return write_tiny_model("deepseek_v4", str(tmp_path_factory.mktemp("v4") / "v4"))


@pytest.fixture(scope="module")
def hf(v4):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(v4, dtype=torch.float32).eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def _llm(v4, **kw):
    args = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, show_progress=False, max_model_len=4096)
    return LLM(v4, **{**args, **kw})


def test_logits_match_transformers(v4, hf):
    llm = _llm(v4)
    assert type(llm.engine.worker.model).__name__ == "DeepseekV4ForCausalLM"
    assert_logprobs_match_hf(llm, hf, _prompts(LENGTHS), 8, "v4")


@pytest.mark.parametrize("chunk", [13, 37])
def test_greedy_equals_transformers_chunked_and_batched(v4, hf, chunk):
    """A batch of mixed lengths (no padding: each against its own reference), prefill
    chunks of an odd size, 32 greedy tokens."""
    llm = _llm(v4, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    prompts = _prompts(LENGTHS, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 32), (chunk, len(p))


def test_prefix_cache_hit_resumes_compression(v4, hf):
    """A shared 128-token prefix (8 blocks) is served from the prefix cache: the window
    K=V, the CSA / HCA entries and the CSA state snapshot at the block edge."""
    llm = _llm(v4, max_num_batched_tokens=64)
    shared = _prompts((128,), seed=3)[0]
    first, second = [shared + t for t in _prompts((5, 21), seed=4)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out1 = llm.generate([{"prompt_token_ids": first}], sp, use_tqdm=False)[0]
    hits = llm.prefix_cache_stats.hits
    out2 = llm.generate([{"prompt_token_ids": second}], sp, use_tqdm=False)[0]
    assert llm.prefix_cache_stats.hits - hits == 128
    assert out1.outputs[0].token_ids == hf_greedy(hf, first, 32)
    assert out2.outputs[0].token_ids == hf_greedy(hf, second, 32)


def test_preemption_recomputes_state(v4, hf):
    """A pool too small for every request at once: requests are preempted, their
    running state dropped and rebuilt on recompute."""
    from lane.core.kv_cache_utils import window_blocks_needed

    groups = _llm(v4, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False).engine.kv_cache_config.groups
    assert [g.kind for g in groups] == ["full", "sliding_window", "state"]
    fewest = window_blocks_needed(16, 16, 4, 2048)[1]
    llm = _llm(v4, kv_cache_memory_bytes=fewest * groups[1].page_size_bytes + 25 * groups[0].page_size_bytes,
               enable_prefix_caching=False, max_model_len=160, max_num_seqs=4)
    assert llm.engine.kv_cache_config.num_blocks[:2] == [25, fewest]
    prompts = _prompts((60, 90, 70, 50), seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 48), len(p)


def test_window_pool_allocation_release_and_prefix_hits():
    """The window group on the real KV manager: a full window pool refuses (the
    scheduler then preempts), released blocks make room, and a prefix hit needs the
    window blocks its next query sees."""
    from lane.core.kv_cache_manager import KVCacheManager
    from lane.core.request import Request
    from lane.kv_cache_interface import FULL, SLIDING_WINDOW, KVCacheConfig, KVCacheGroupSpec

    kv = KVCacheManager(KVCacheConfig([KVCacheGroupSpec(FULL, 16, [], []),
                                       KVCacheGroupSpec(SLIDING_WINDOW, 16, [], [], sliding_window=16)], [50, 4]),
                        enable_caching=True)
    window = kv.coordinator.managers[1]
    a = Request("a", list(range(3, 43)), SamplingParams(max_tokens=4))  # 40 tokens: 3 blocks
    b = Request("b", list(range(100, 120)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(a, 40) is not None and window.pool.num_free_blocks == 0
    assert kv.allocate_slots(b, 20) is None  # window pool full
    a.num_computed_tokens = 40
    kv.cache_blocks(a)  # the next query (position 40) sees 25..40: block 0 is released
    assert kv.get_block_ids("a")[1][0] == 0 and window.pool.num_free_blocks == 1
    assert len(kv.get_block_ids("a")[0]) == 3  # the main table keeps every block
    assert kv.allocate_slots(b, 16) is not None
    kv.free(a)
    kv.free(b)
    # a's first 2 blocks are cached in both groups (block 0 of the window pool released but findable)
    c = Request("c", list(range(3, 35)) + [7, 8, 9], SamplingParams(max_tokens=4))
    computed, n_hit = kv.get_computed_blocks(c)
    assert n_hit == 32 and computed.blocks[1][0] is window.pool.null_block  # only block 1 is needed
    assert computed.blocks[1][1].block_hash == c.block_hashes[1]


def test_cache_accounting_matches_explain(v4):
    """Per layer type, the pools hold what `lane explain` reports; what V4 keeps for the
    whole context is a small fraction of a dense MHA cache of the same width."""
    llm = _llm(v4, dtype="bfloat16", kv_cache_memory_bytes=8 << 20)
    kv = llm.engine.kv_cache_config
    d, di, bs = 32, 16, 16
    # kept for the whole context: CSA (entry + indexer key) / 4 + fp32 snapshot per block; HCA entry / 16
    csa, hca = (d + di) * 2 / 4 + 3 * (d + di) * 4 / bs, d * 2 / 16
    assert [g.kind for g in kv.groups] == ["full", "sliding_window", "state"]
    assert kv.groups[0].page_size_bytes == bs * (2 * csa + hca)
    assert kv.groups[1].page_size_bytes == bs * d * 2 * 4  # K=V in every layer
    text = explain(v4, "bfloat16", None, 8 << 20)
    assert "backend: compressed" in text
    for name, value in (("sliding_attention", 0), ("compressed_sparse_attention", csa),
                        ("heavily_compressed_attention", hca)):
        assert f"{name}: {value:,.1f} B" in text and "window K=V 64.0 B" in text, (name, text)
    blocks = int(text.split("->")[-1].split("blocks")[0].replace(",", ""))
    assert blocks == kv.num_blocks[0]
    assert f"its own pool of {kv.num_blocks[1] - 1:,} blocks" in text
    dense_mha = 2 * 4 * d * 2  # K and V for 4 heads of 32, bf16
    assert (2 * csa + hca) / 4 < dense_mha / 10
    assert kv.num_blocks[2] == llm.config.scheduler_config.max_num_seqs + 1  # running-state slots


def test_window_blocks_are_released(v4, hf):
    """Window blocks no future query can see go back to the window pool while the request
    runs; its compressed entries stay."""
    llm = _llm(v4, enable_prefix_caching=False)
    main, window = llm.engine.scheduler.kv.coordinator.managers[:2]
    prompt = _prompts((200,), seed=8)[0]
    rid = llm._add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40,
                                                                          ignore_eos=True))
    held = []
    out = None
    while llm.engine.has_unfinished_requests():
        for o in llm._step():
            out = o
        if rid in window.req_to_blocks:
            blocks = window.req_to_blocks[rid]
            held.append(sum(b is not window.pool.null_block for b in blocks))
            assert len(main.req_to_blocks[rid]) == len(blocks)  # the main table keeps every block
    assert held and max(held) <= 2  # a 16-token window over 16-token blocks: at most 2 blocks
    assert window.pool.num_free_blocks == window.pool.num_blocks  # all back after it finished
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)


def test_legacy_compress_ratios_config(tmp_path):
    """The legacy form (compress_ratios 0 / 4 / 128 per layer, rates 4 and 128): the block
    size defaults to 128 (whole windows per block), and a 300-token prompt crosses two
    HCA windows."""
    from transformers import AutoModelForCausalLM

    d = write_tiny_model("deepseek_v4", str(tmp_path / "legacy"), layer_types=None, compress_rates=None,
                         compress_ratios=[0, 4, 128, 4])
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert hf.config.compress_rates["heavily_compressed_attention"] == 128
    llm = _llm(d)
    assert llm.config.cache_config.block_size == 128
    assert_logprobs_match_hf(llm, hf, _prompts((300,), seed=6), 4, "legacy")
    with pytest.raises(ValueError, match="--block-size 16 must be a multiple of 128"):
        _llm(d, block_size=16)


def test_trace_names_layer_types_and_routing(v4):
    spans = traced_spans(_llm(v4), _prompts((40,))[0], 2)
    forwards = sum(s.step == 20 for s in spans)

    def attr_values(step, key):
        return [s.attrs.get(key) for s in spans if s.step == step]
    # per forward: 23 for all 4 layers plus the 3 compressed layers' compressor update
    assert sorted(attr_values(27, "layer_type")) == sorted(
        ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"] * forwards)
    assert set(attr_values(25, "layer_type")) == {"compressed_sparse_attention"}
    assert sorted(attr_values(29, "routing")) == sorted(["hash", "learned", "learned", "learned"] * forwards)
    assert len(attr_values(23, "layer_type")) == (4 + 3) * forwards


def test_fp8_dense_weights_dequantised_on_load(tmp_path):
    """V4 ships its dense attention / shared-expert linears in FP8 with ``.scale`` block
    scales; lane dequantises them on load (reference computed here, block by block)."""
    from safetensors import safe_open

    d = write_tiny_model("deepseek_v4", str(tmp_path / "fp8"), fp8=True)
    llm = _llm(d, kv_cache_memory_bytes=8 << 20)
    params = dict(llm.engine.worker.model.named_parameters())
    with safe_open(f"{d}/model.safetensors", "pt") as st:
        for name in ("layers.1.attn.wq_b", "layers.2.attn.wo_a", "layers.3.ffn.shared_experts.w2"):
            q, s = st.get_tensor(f"model.{name}.weight"), st.get_tensor(f"model.{name}.scale")
            assert q.dtype == torch.float8_e4m3fn
            ref = torch.empty(q.shape)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    blk = (slice(32 * i, 32 * (i + 1)), slice(32 * j, 32 * (j + 1)))
                    ref[blk] = q[blk].float() * s[i, j]
            assert torch.equal(params[f"{name}.weight"], ref), name
        # compressor projections stay unquantised, as released
        assert torch.equal(params["layers.1.attn.compressor.wkv.weight"],
                           st.get_tensor("model.layers.1.attn.compressor.wkv.weight"))
    out = llm.generate([{"prompt_token_ids": _prompts((30,))[0]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_transformers_internal_weight_names_load(v4, hf, tmp_path):
    """A checkpoint in transformers' own names (``self_attn.q_a_proj``, fused 3-D
    ``mlp.experts.gate_up_proj``, ``attn_hc.fn``, ``lm_head``...) loads to the same model."""
    import shutil

    from safetensors.torch import save_file

    d = tmp_path / "hf-names"
    shutil.copytree(v4, d, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "lm_head.weight" in state
    save_file(state, str(d / "model.safetensors"))
    # (transformers keeps no MTP layer: the copy has none)
    a = {k: v for k, v in _llm(v4).engine.worker.model.named_parameters() if not k.startswith("mtp.")}
    b = dict(_llm(str(d)).engine.worker.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_block_edge_snapshots_only_with_prefix_caching(v4):
    """The CSA snapshots (3 x (d + d_I) float32 per block and layer) exist to resume
    compression after a prefix hit: allocated with prefix caching only; `lane explain`
    shows both figures."""
    d, di, bs = 32, 16, 16
    csa_off, hca = (d + di) * 2 / 4, d * 2 / 16  # bf16 entries + indexer keys / 4; HCA entries / 16
    csa_on = csa_off + 3 * (d + di) * 4 / bs
    for caching, csa in ((True, csa_on), (False, csa_off)):
        kv = _llm(v4, dtype="bfloat16", enable_prefix_caching=caching).engine.kv_cache_config
        assert kv.groups[0].page_size_bytes == bs * (2 * csa + hca)
        assert any(n.endswith("entry_snap") for n in kv.groups[0].layer_names) == caching
        text = explain(v4, "bfloat16", None, 8 << 20, enable_prefix_caching=caching)
        assert f"compressed_sparse_attention: {csa:,.1f} B x 2 layers" in text
        assert (f"kept for the whole context: {2 * csa_on + hca:,.1f} B per token with prefix caching" in text
                and f"{2 * csa_off + hca:,.1f} B without (--no-enable-prefix-caching); "
                    f"this run: {'on' if caching else 'off'}" in text), text


def test_explain_v4_flash_shape(tmp_path):
    """transformers' DeepseekV4Config() defaults (the V4-Flash shape), explained from a
    weightless model: 7,784 B per token kept with the snapshots, 6,584 B without them."""
    import json
    import subprocess
    import sys

    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config().to_dict()
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for flag, figure in (("--enable-prefix-caching", "7,784.0"), ("--no-enable-prefix-caching", "6,584.0")):
        r = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "explain", str(tmp_path), "--dtype",
                            "bfloat16", flag], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert f"per token, all 43 layers: {figure} B kept for the whole context" in r.stdout, r.stdout
