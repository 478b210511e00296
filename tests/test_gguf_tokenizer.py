"""GGUF dequantisation, llama.cpp's Q/K permutation, the tokenizer built from GGUF
metadata, and incremental detokenisation with stop strings."""
import os
import warnings

import gguf
import numpy as np
import pytest
import torch

from lane.config import ModelConfig, default_model_path
from lane.engine.detokenizer import IncrementalDetokenizer
from lane.model_executor.loader.gguf_loader import _unpermute, dequantize

Q = gguf.GGMLQuantizationType
SHAPE = (8, 256)


@pytest.fixture(scope="module")
def weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal(SHAPE) * 2.0).astype(np.float32)


@pytest.fixture(scope="module")
def tok():
    return ModelConfig(default_model_path()).get_tokenizer()


# -- dequantisation ----------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16, Q.F32, Q.Q5_0],
                         ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(weights, qtype):
    data = gguf.quants.quantize(weights, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    out = dequantize(data, qtype, SHAPE)
    assert out.dtype == torch.float32
    assert tuple(out.shape) == SHAPE
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # sanity: the quantised values are an approximation of the input, not garbage
    tol = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 5e-2}.get(qtype, 1.0)
    assert (out - torch.from_numpy(weights)).abs().max().item() <= tol


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.F16], ids=lambda q: q.name)
def test_dequantize_flat_readonly_data_and_other_shape(weights, qtype):
    """The GGUF reader hands out read-only mmap views; the target shape need not
    match the byte layout's 2-D shape."""
    data = gguf.quants.quantize(weights, qtype).reshape(-1).copy()
    data.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable numpy arrays
        out = dequantize(data, qtype, (2, 4, 256))
    ref = gguf.quants.dequantize(gguf.quants.quantize(weights, qtype), qtype)
    torch.testing.assert_close(out, torch.from_numpy(ref.astype(np.float32)).reshape(2, 4, 256),
                               rtol=1e-6, atol=1e-6)


def test_dequantize_real_tensors_of_embedded_gguf():
    reader = gguf.GGUFReader(default_model_path())
    by_name = {t.name: t for t in reader.tensors}
    for name, rows in [("blk.0.attn_k.weight", None), ("blk.0.attn_norm.weight", None),
                       ("token_embd.weight", 512)]:
        t = by_name[name]
        data = t.data if rows is None else t.data[:rows]
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if rows is not None:
            shape = (rows, *shape[1:])
        out = dequantize(data, t.tensor_type, shape)
        ref = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
        torch.testing.assert_close(out, torch.from_numpy(ref), rtol=1e-6, atol=1e-6)
    assert by_name["blk.0.attn_k.weight"].tensor_type == Q.Q4_1
    assert by_name["token_embd.weight"].tensor_type == Q.Q8_0


# -- llama.cpp's Q/K permutation ----------------------------------------------

def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half -> interleaved)."""
    d = w.shape[0]
    return w.reshape(n_head, 2, d // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 8, 5), (2, 16, None)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    g = torch.Generator().manual_seed(n_head)
    shape = (n_head * head_dim,) if cols is None else (n_head * head_dim, cols)
    w = torch.randn(shape, generator=g)
    p = llama_cpp_permute(w, n_head)
    assert not torch.equal(p, w)  # the permutation is not trivial
    assert torch.equal(_unpermute(p, n_head), w)


def test_unpermute_one_head_order():
    # HF rows of one head [x0 x1 | y0 y1]; GGUF stores the pairs interleaved [x0 y0 x1 y1]
    gguf_rows = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert _unpermute(gguf_rows, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


# -- tokenizer from GGUF metadata ----------------------------------------------

def test_vocab_and_special_ids(tok):
    assert len(tok) == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(0) == "<|endoftext|>"


def test_digits_split_one_per_token(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    ids = tok.encode("year 2024")
    assert [tok.decode([i]) for i in ids][-4:] == ["2", "0", "2", "4"]
    # the split happens in the pre-tokenizer (SmolLM2's tokenizer.json has
    # Digits(individual_digits=True) before the byte-level split), not only by
    # the vocabulary lacking multi-digit tokens
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("abc 12345")]
    assert pieces[-5:] == list("12345")


@pytest.mark.parametrize("special,tid", [("<|im_start|>", 1), ("<|im_end|>", 2), ("<|endoftext|>", 0)])
def test_special_tokens_encode_whole(tok, special, tid):
    assert tok.encode(special) == [tid]
    ids = tok.encode(f"hi{special}there")
    assert tid in ids and len(ids) == 3


def test_no_bos_added_to_plain_text(tok):
    ids = tok.encode("Hello")
    assert ids == tok.encode("Hello", add_special_tokens=False)
    assert 1 not in ids


def test_chat_template_is_chatml_with_default_system(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"}],
                                   tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 2 and ids.count(2) == 2 and ids[0] == 1


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界",
    "🙂🚀",
    "  indented\n\tand tabs, 3.14159 — ÀÉÎ ß",
])
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids
    assert tok.decode(ids) == text


def test_matches_transformers_gguf_tokenizer(tok):
    """transformers' own GGUF tokenizer conversion is the reference."""
    from transformers import AutoTokenizer

    d, f = os.path.split(default_model_path())
    ref = AutoTokenizer.from_pretrained(d, gguf_file=f)
    for s in ["Hello world", "  leading spaces", "tabs\tand\nnewlines\n\n",
              "Numbers 3.14159 and 2024-01-01", "你好，世界🙂🚀", "It's don't we'll",
              "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x**2  # c"]:
        assert tok.encode(s) == ref.encode(s), s


# -- incremental detokenisation -----------------------------------------------

def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None, int | None]:
    """Feed ids one at a time; return (deltas, stop string, index of the token that stopped)."""
    deltas = []
    for i, tid in enumerate(ids):
        hit = detok.update([tid])
        deltas.append(detok.get_delta(finished=False))
        if hit is not None:
            deltas.append(detok.get_delta(finished=True))
            return deltas, hit, i
    deltas.append(detok.get_delta(finished=True))
    return deltas, None, None


def test_streaming_multibyte_text_never_breaks(tok):
    text = "中文和表情：你好，世界🙂🚀 ok 👩‍💻!"
    ids = tok.encode(text)
    # the test is only meaningful if some characters span several tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=True,
                                   include_stop_str_in_output=False)
    deltas, hit, _ = stream(detok, ids)
    assert hit is None
    assert "".join(deltas) == text == detok.output_text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip):
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=skip)
    deltas, _, _ = stream(detok, ids)
    want = "assistant\nHi!" if skip else "<|im_start|>assistant\nHi!<|im_end|>"
    assert "".join(deltas) == want


def _first_token_completing(tok, ids, s):
    return next(i for i in range(len(ids)) if s in tok.decode(ids[: i + 1]))


@pytest.mark.parametrize("stop,expected", [
    ("goodbye", "Hello world, "),  # " goodbye" is a single token
    ("d, goo", "Hello worl"),  # spans three tokens: the start is held back meanwhile
    (", goodbye w", "Hello world"),
])
def test_stop_string_excluded(tok, stop, expected):
    text = "Hello world, goodbye world"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=[stop], skip_special_tokens=True,
                                   include_stop_str_in_output=False)
    deltas, hit, at = stream(detok, ids)
    assert hit == stop
    assert at == _first_token_completing(tok, ids, stop)
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # hold-back: at every point what was sent is a prefix of the final text
    sent = ""
    for d in deltas:
        sent += d
        assert detok.output_text.startswith(sent), (sent, detok.output_text)


def test_stop_string_included(tok):
    ids = tok.encode("Hello world, goodbye world")
    detok = IncrementalDetokenizer(tok, stop=["goodbye"], include_stop_str_in_output=True)
    deltas, hit, _ = stream(detok, ids)
    assert hit == "goodbye"
    assert detok.output_text == "Hello world, goodbye"
    assert "".join(deltas) == "Hello world, goodbye"


def test_stop_string_in_one_update_and_earliest_wins(tok):
    ids = tok.encode("Hello world, goodbye world")
    detok = IncrementalDetokenizer(tok, stop=["goodbye", "world"])
    assert detok.update(ids) == "world"
    assert detok.output_text == "Hello "
    assert detok.get_delta(finished=True) == "Hello "


def test_held_back_partial_match_is_released(tok):
    """A prefix of a stop string that never completes must still come out."""
    text = "Hello world, good morning"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["goodbye"])
    deltas, hit, _ = stream(detok, ids)
    assert hit is None
    assert "".join(deltas) == text
    # while streaming, the last len("goodbye") - 1 characters were held back
    streamed = "".join(deltas[:-1])
    assert len(streamed) <= len(text) - (len("goodbye") - 1)
    assert text.startswith(streamed)


def test_stop_string_spanning_multibyte_tokens(tok):
    text = "前言🙂🚀结束 tail"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["🚀结"])
    deltas, hit, _ = stream(detok, ids)
    assert hit == "🚀结"
    assert detok.output_text == "前言🙂"
    assert "".join(deltas) == "前言🙂"
    assert not any("\ufffd" in d for d in deltas)


def test_gguf_file_matches_gguf_reader():
    """lane's lean GGUF reader sees exactly what the gguf package sees."""
    import gguf
    import numpy as np

    from lane.config import default_model_path
    from lane.transformers_utils.gguf_file import GGUFFile

    path = default_model_path()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for k in keys:
        v = ref.fields[k].contents()
        if isinstance(v, float):
            assert ours.metadata[k] == pytest.approx(v)
        else:
            assert ours.metadata[k] == v, k
    assert len(ours.tensors) == len(ref.tensors) == 272
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert a.shape == tuple(reversed(b.shape.tolist()))
        assert np.array_equal(a.data, b.data.reshape(-1).view(np.uint8)), a.name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequant_kernel_is_the_reference_rounded_once(weights, qtype, dtype):
    """The CPU kernel dequantises straight into the model dtype: gguf's float32 values
    exactly, rounded once to the dtype."""
    from lane.model_executor.layers import cpu_kernels

    assert cpu_kernels.build(), "the CPU kernels failed to build"
    data = gguf.quants.quantize(weights, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(-1)
    out = cpu_kernels.dequant_ggml(np.ascontiguousarray(data).view(np.uint8), qtype.name, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, ref.to(dtype))


# -- SentencePiece-style (Metaspace) tokenizers: the first output token's space --------

METASPACE_CORPUS = [
    "The capital of France is Paris and the capital of Italy is Rome.",
    "Once upon a time there was a fox who lived in a forest near the river.",
    "Hello world, goodbye world. The quick brown fox jumps over the lazy dog.",
    "In the morning the sun rises over the hills and the birds begin to sing.",
]


@pytest.fixture(scope="module")
def metaspace_model(tmp_path_factory):
    """A tiny random Llama with a SentencePiece-style tokenizer (Metaspace, as Llama 2, Mistral
    and many GGUFs have): a word's leading space lives in its token ("▁Paris") and the decoder
    drops it at the start of a text, so decoding output tokens alone loses it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import make_tiny_checkpoint

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tk.decoder = decoders.Metaspace(prepend_scheme="first")
    tk.train_from_iterator(METASPACE_CORPUS * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("metaspace"), tok, vocab_size=len(tok))
    return path, tok


def test_metaspace_first_token_keeps_its_space(metaspace_model):
    """Output text, offline and served, streamed or not, with echo, is what decoding
    prompt + output gives after the prompt's own text (vLLM primes its decoder so)."""
    from lane import LLM, SamplingParams
    from utils import RemoteServer

    path, tok = metaspace_model
    prompts = ["The capital of France is", "Once upon a time there was", "Hello world, the quick brown",
               "In the morning the sun"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512, show_progress=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    wants = []
    for prompt, out in zip(prompts, outs):
        ids, gen = out.prompt_token_ids, out.outputs[0].token_ids
        assert tok.decode(ids, skip_special_tokens=True) == prompt
        want = tok.decode(ids + gen, skip_special_tokens=True)[len(prompt):]
        assert out.outputs[0].text == want
        assert "".join(llm.stream(prompt, params)) == want
        wants.append(want)
    # the case at stake occurred: some output starts with a "▁word" token
    assert any(tok.convert_ids_to_tokens(o.outputs[0].token_ids[0]).startswith("▁") for o in outs)
    del llm
    with RemoteServer([path, "--dtype", "float32", "--kv-cache-memory-bytes", "16M", "--max-model-len", "512"]) as s:
        c = s.client()
        model = c.models.list().data[0].id
        for prompt, want in zip(prompts, wants):
            kw = dict(model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
            assert c.completions.create(**kw).choices[0].text == want
            assert c.completions.create(**kw, echo=True).choices[0].text == prompt + want
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, echo=True, stream=True)
                               if ch.choices)
            assert streamed == prompt + want


PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_metaspace_logprob_tokens_keep_their_space(metaspace_model):
    """Logprob token strings read as the text does (" Paris", as vLLM returns them, not
    "Paris"): offline, and served on both routes, the sampled tokens' strings join to the
    output text, and the top alternatives' strings keep their space too."""
    from lane import LLM, SamplingParams
    from utils import RemoteServer

    path, tok = metaspace_model
    prompt = "The capital of France is"
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512, show_progress=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    del llm
    strings = [lp[t].decoded_token for t, lp in zip(out.token_ids, out.logprobs)]
    assert "".join(strings) == out.text
    spaced = [t for t in out.token_ids if tok.convert_ids_to_tokens(t).startswith("\u2581")]
    assert spaced  # the case at stake: "\u2581word" tokens were sampled
    for lp in out.logprobs:
        for t, v in lp.items():
            assert v.decoded_token == tok.convert_ids_to_tokens(t).replace("\u2581", " ")
    with RemoteServer([path, "--dtype", "float32", "--kv-cache-memory-bytes", "16M", "--max-model-len", "512"]) as s:
        c = s.client()
        model = c.models.list().data[0].id
        r = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=3,
                                 extra_body={"ignore_eos": True}).choices[0]
        assert r.text == out.text and r.logprobs.tokens == strings
        assert all(set(top) <= {v.decoded_token for v in lp.values()}
                   for top, lp in zip(r.logprobs.top_logprobs, out.logprobs))
        m = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=10,
                                      temperature=0, logprobs=True, top_logprobs=3, extra_body={
                                          "ignore_eos": True, "chat_template": PLAIN_TEMPLATE}).choices[0]
        content = m.logprobs.content
        assert "".join(t.token for t in content) == m.message.content
        assert any(t.token.startswith(" ") for t in content)
        assert all(bytes(t.bytes).decode() == t.token for t in content)
