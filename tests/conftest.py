import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

from lane.bench.quality import teacher_forced_logits  # noqa: F401  (the tests' reference)
from lane.config import default_model_path

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    "Write a short poem about the sea. The waves",
    "In computer science, a hash table is a data structure that implements an associative "
    "array, also called a dictionary. It uses a hash function to compute an index into an "
    "array of buckets, from which the desired value can be found. Explain why",
]


@pytest.fixture(scope="session")
def smollm_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf):
    """HF transformers' own load of the packaged GGUF, float32: the reference."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm_gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


# `lane serve` on the embedded SmolLM2 in float32 with no special flags, shared by the tests
# that leave it as they found it (one server start, ~12 s on a slow VM, instead of one a file)
PLAIN_SERVER_ARGS = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory-bytes", "256M",
                     "--max-model-len", "2048", "--served-model-name", "smollm"]


@pytest.fixture(scope="session")
def plain_server():
    from utils import RemoteServer

    with RemoteServer(PLAIN_SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="session")
def lane_smollm_fp32(smollm_gguf):
    from lane import LLM

    # the float32 path (weights dequantized at load): what equals HF transformers
    return LLM(smollm_gguf, dtype="float32", quantization="none", kv_cache_memory_bytes=512 << 20,
               max_model_len=2048, show_progress=False)


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with HF's KV cache; EOS is neither suppressed nor a stop."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, new = out.past_key_values, []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return new


class DsaNearTies:
    """Watches transformers' DeepSeek V3.2 indexers choose each query's top-k keys and
    records the near ties: query rows whose k-th and (k+1)-th index scores are within
    ``rel_tol`` of the row's largest |score|.

    The selection is a discontinuous function of those scores. Two float32
    computations of the same scores (transformers' cached decode vs its own full
    forward, lane vs transformers, one CPU's GEMM blocking vs another's) differ by
    ~1e-6 relative, so at a near tie either key may be chosen, and what that row
    then computes differs by O(1): from there on the greedy tokens are not
    determined by the model in float32 (transformers disagrees with itself).
    Use as ``with DsaNearTies(model) as ties:``, then ``ties.undetermined(pos)``.
    """

    # 1e-4: ~20x the largest lane-vs-transformers index-score difference seen on the
    # tiny V3.2 model (5e-6 relative, last layer), and >100x a tie that flipped
    def __init__(self, model, rel_tol: float = 1e-4) -> None:
        self.rel_tol = rel_tol
        self.ties: set[tuple[int, int]] = set()  # (layer, query position)
        self._indexers = [m for m in model.modules()
                          if type(m).__name__ in ("DeepseekV32Indexer", "GlmMoeDsaIndexer")]
        self._last_layer = max((ix.layer_idx for ix in self._indexers), default=-1)

    def __enter__(self) -> "DsaNearTies":
        from torch.overrides import TorchFunctionMode

        watch = self

        class TopkInputs(TorchFunctionMode):
            def __init__(self, layer: int) -> None:
                super().__init__()
                self.layer = layer

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in (torch.Tensor.topk, torch.topk):
                    watch._check(self.layer, args[0], args[1] if len(args) > 1 else kwargs["k"])
                return func(*args, **(kwargs or {}))

        for ix in self._indexers:  # the mode is on only inside an indexer, whose one topk is over keys
            def forward(*a, _orig=ix.forward, _layer=ix.layer_idx, **kw):
                with TopkInputs(_layer):
                    return _orig(*a, **kw)
            ix.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for ix in self._indexers:
            del ix.forward  # back to the class's

    def _check(self, layer: int, scores: torch.Tensor, k: int) -> None:
        """scores [1, S, T]: the S newest of T positions (T == S in a full forward)."""
        S, T = scores.shape[-2:]
        rows = scores.reshape(S, T).double()
        for r in range(S):
            pos = T - S + r
            if pos + 1 <= k:  # every earlier key is selected
                continue
            row = rows[r, :pos + 1]  # causal; no padding in these tests
            top = row.topk(k + 1).values
            if top[k - 1] - top[k] <= self.rel_tol * row.abs().max():
                self.ties.add((layer, pos))

    def undetermined(self, pos: int) -> bool:
        """Whether the logits at position pos depend on a near tie: one in the last
        layer at pos itself, or one in an earlier layer at or before pos (it reaches
        later rows through the keys and values of the layers above)."""
        return any(p == pos if layer == self._last_layer else p <= pos for layer, p in self.ties)


def assert_greedy_equals_hf(hf, ids: list[int], got: list[int], n: int, msg=()) -> int:
    """``got`` equals transformers' cached greedy decoding of ``ids`` (hf_greedy), up
    to the first token where they part; they may part only at a token that a DSA
    near tie leaves undetermined (see DsaNearTies), after which nothing is
    comparable. Returns how many tokens were compared (n when they never part)."""
    assert len(got) == n, msg
    with DsaNearTies(hf) as ties:
        ref = hf_greedy(hf, ids, n)
    for j, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert ties.undetermined(len(ids) - 1 + j), (*msg, f"token {j}: {a} != {b}", got, ref)
            return j
    return n


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf):
    from lane.config import ModelConfig

    return ModelConfig(smollm_gguf).get_tokenizer()


TINY_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2, initializer_range=0.2)


def make_tiny_checkpoint(arch: str, out_dir, tokenizer, max_shard_size=None, **overrides) -> str:
    """A small random HF checkpoint of ``arch`` with SmolLM2's tokenizer."""
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    cfg = cfg_cls(**{**TINY_COMMON, **overrides})
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF zeroes / ones these: make them count
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def assert_logprobs_match_hf(llm, hf, prompts: list[list[int]], n_new: int, case: str = "",
                             tol: float = 2e-4) -> None:
    """lane's greedy tokens, and its top-5 logprobs at every step, against one HF
    forward over prompt + generated tokens (float32). A row whose logits a DSA
    near tie leaves undetermined (DsaNearTies; V3.2 only) may differ."""
    from lane import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n_new, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        assert len(gen) == n_new
        with torch.no_grad(), DsaNearTies(hf) as ties:
            ref = hf(torch.tensor([ids + gen])).logits[0].float().log_softmax(-1)
        for t, tok in enumerate(gen):
            row = ref[len(ids) - 1 + t]
            lane_lp = out.outputs[0].logprobs[t]
            ref_top = row.topk(5)
            same = tok == int(row.argmax()) and all(
                tid in lane_lp and abs(lane_lp[tid].logprob - val) <= tol
                for tid, val in zip(ref_top.indices.tolist(), ref_top.values.tolist()))
            if same or ties.undetermined(len(ids) - 1 + t):
                continue
            assert tok == int(row.argmax()), (case, len(ids), t)
            for tid, val in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
                assert tid in lane_lp
                assert lane_lp[tid].logprob == pytest.approx(val, abs=tol), (case, len(ids), t, tid)


def traced_spans(llm, prompt_token_ids: list[int], max_tokens: int, layer_detail: bool = True) -> list:
    """The spans one greedy generation records with tracing on (then off again)."""
    from lane import SamplingParams
    from lane.tracing import tracer

    try:
        tracer.enable(layer_detail=layer_detail)
        tracer.drain()
        llm.generate([{"prompt_token_ids": prompt_token_ids}],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return tracer.drain()
    finally:
        tracer.enabled = tracer.layer_detail = False
        tracer.drain()


def narrower_isas() -> list[str]:
    from lane import platform

    return [i for i in platform.CPU_ISAS if platform.CPU_ISAS.index(i) < platform.CPU_ISAS.index(platform.native_cpu_isa())]


def rel_to_terms(y: torch.Tensor, terms: torch.Tensor) -> float:
    """Worst error of y [M, N] against the float64 sum of its terms [M, N, T], relative to the sum
    of their magnitudes (a sum that cancels to near zero is held to the size of its parts)."""
    return float(((y.double() - terms.sum(-1)).abs() / terms.abs().sum(-1)).max())


def check_kernels_on(module: str, isa: str, **env: str) -> dict:
    """Run tests/<module>.py's ``check_kernels()`` in a subprocess whose kernel build is capped at
    ``isa`` (with extra env, as LANE_CPU_VNNI=0); returns its JSON result, whose isa it checks."""
    import json
    import subprocess
    import sys

    code = (f"import json, sys; sys.path.insert(0, 'tests'); import {module} as t; "
            "from lane.model_executor.layers import cpu_kernels; assert cpu_kernels.build(); "
            "print(json.dumps(t.check_kernels()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LANE_CPU_ISA": isa, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["isa"] == isa
    return out
