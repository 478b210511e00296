"""`lane tiny-model` and `lane explain`, as users run them."""
import json
import subprocess
import sys

import pytest

from lane.entrypoints.explain import explain
from lane.entrypoints.tiny_model import write_tiny_model

LANE = [sys.executable, "-m", "lane.entrypoints.cli"]


def lane(*args, timeout=300):
    return subprocess.run([*LANE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    r = lane("tiny-model", "llama", str(root / "llama"))  # the command, once
    assert r.returncode == 0, r.stderr
    out["llama"] = str(root / "llama")
    for arch in ("qwen3", "deepseek_v3", "deepseek_v32", "deepseek_v4"):  # what it calls, in-process
        out[arch] = write_tiny_model(arch, str(root / arch))
    return out


def test_tiny_models_load_in_transformers(tiny_dirs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for arch, path in tiny_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert len(tok) == 49152 and model.config.vocab_size == 49152
        assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
        ids = torch.tensor([tok.encode("Once upon a time")])
        assert model(ids).logits.shape == (1, ids.shape[1], 49152), arch


def test_explain_default_model_matches_the_engine_pool(lane_smollm_fp32, smollm_gguf):
    text = explain(smollm_gguf, "float32", 16, 512 << 20)
    assert "registered: yes, LlamaForCausalLM by built-in" in text
    assert "lane.model_executor.models.llama:LlamaForCausalLM" in text
    assert "backend: paged_sdpa" in text
    assert "kernels here: the int8 kernels (8-bit activations" in text  # (float32 rows: on every CPU)
    from lane.model_executor.layers import cpu_kernels
    bf16 = explain(smollm_gguf, "bfloat16", 16, 512 << 20)
    assert ("Q4_0 / Q4_1: AMX-BF16 tiles" in bf16) == cpu_kernels.x8_bf16_amx(), bf16
    assert "2 x 3 KV heads x 64 = 1,536 B" in text  # float32
    blocks = int(text.split("->")[-1].split("blocks")[0].replace(",", ""))
    assert blocks == lane_smollm_fp32.engine.kv_cache_config.num_blocks[0]


def test_explain_deepseek_latent_cache(tiny_dirs):
    v3 = explain(tiny_dirs["deepseek_v3"], "bfloat16")
    assert "architectures: DeepseekV3ForCausalLM" in v3 and "backend: mla" in v3
    assert "latent 32 + rope key 8 = 80 B" in v3 and "full K/V for every head would take 320 B" in v3
    v32 = explain(tiny_dirs["deepseek_v32"], "bfloat16")
    assert "backend: sparse_mla" in v32 and "index_topk=16" in v32
    assert "latent 32 + rope key 8 + indexer key 32 = 144 B" in v32


def test_explain_unregistered_and_incomplete_configs(tmp_path, tiny_dirs):
    cfg = json.load(open(f"{tiny_dirs['llama']}/config.json"))
    for name, patch in (("foobar", {"architectures": ["FooBarForCausalLM"], "model_type": "foobar"}),
                        ("noarch", {"architectures": None})):
        d = tmp_path / name
        d.mkdir()
        json.dump({**cfg, **patch}, open(d / "config.json", "w"))
        r = lane("explain", str(d))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        if name == "foobar":
            assert "registered: no" in r.stdout and "FooBarForCausalLM" in r.stdout
            assert "lane.general_plugins" in r.stdout and "backend: paged_sdpa" in r.stdout
        else:
            assert "no `architectures`" in r.stdout
    r = lane("explain", "/no/such/model")
    assert r.returncode == 2 and "does not exist" in r.stderr
