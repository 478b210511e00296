"""GGUF files (seed step 4): config, tokenizer and dequantised weights.

Metadata and tensor records come from ``gguf_file.GGUFFile`` (memory-mapped);
the ``gguf`` package supplies the quantisation tables and the fallback dequantiser. F32/F16/BF16/Q8_0/Q4_0/Q4_1 are
dequantised here in torch; other quantisation types fall back to gguf's numpy
dequantiser. llama.cpp stores Llama's Q and K rows permuted for its rope
kernel; we undo that so the weights match HF's rotate-half layout.
"""
from __future__ import annotations

import functools
import re
from typing import Iterator

import numpy as np
import torch

from lane.model_executor.loader.gguf_file import GGUFFile

GGUF_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFFile:
    """Parsed once per process."""
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default=None):
    return reader.metadata.get(key, default)


def gguf_to_hf_config(reader):
    """A transformers config built from the GGUF metadata."""
    from transformers import AutoConfig

    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCH_TO_HF:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(GGUF_ARCH_TO_HF))}")
    p = f"{arch}."
    n_heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    kw = dict(
        architectures=[GGUF_ARCH_TO_HF[arch]],
        vocab_size=_field(reader, p + "vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=_field(reader, p + "feed_forward_length"),
        num_hidden_layers=_field(reader, p + "block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=_field(reader, p + "attention.head_count_kv", n_heads),
        max_position_embeddings=_field(reader, p + "context_length", 4096),
        rms_norm_eps=_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_field(reader, p + "rope.freq_base", 10000.0),
        head_dim=_field(reader, p + "attention.key_length", hidden // n_heads),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    model_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(kw["rope_theta"])}
    return cfg


# -- dequantisation ----------------------------------------------------------

def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: low nibbles first, then high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One GGUF tensor -> a torch tensor of ``shape`` (torch order) in ``dtype``. The
    values are gguf's reference (and so transformers'): float32 math, then one rounding
    to ``dtype``. Q4_0 / Q4_1 / Q8_0 go through the CPU kernel where it is built."""
    import gguf

    from lane.model_executor.layers import cpu_kernels

    Q = gguf.GGMLQuantizationType
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1) and cpu_kernels.build():  # waits for a build in flight
        # read in place from the mmap: no copy
        return cpu_kernels.dequant_ggml(np.ascontiguousarray(data).view(np.uint8), Q(qtype).name,
                                        dtype).reshape(shape)
    raw = torch.from_numpy(np.array(data, copy=True))  # the mmap is read-only
    if qtype == Q.F32:
        return raw.view(torch.float32).reshape(shape).to(dtype, copy=True)
    if qtype == Q.F16:
        return raw.view(torch.float16).reshape(shape).float().to(dtype)
    if qtype == Q.BF16:
        return raw.view(torch.int16).view(torch.bfloat16).reshape(shape).float().to(dtype)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = raw.view(torch.uint8).reshape(-1, type_size)
        d = _f16(blocks[:, 0:2])
        if qtype == Q.Q8_0:
            vals = d * blocks[:, 2:].contiguous().view(torch.int8).float()
        elif qtype == Q.Q4_0:
            vals = d * (_nibbles(blocks[:, 2:]) - 8.0)
        else:
            m = _f16(blocks[:, 2:4])
            vals = d * _nibbles(blocks[:, 4:]) + m
        return vals.reshape(shape).to(dtype)
    # any other type: gguf's reference numpy dequantiser
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(shape).to(dtype)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> rotate-half)."""
    d = w.shape[0]
    return w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _TENSOR_NAMES:
            return None
        return f"model.layers.{layer}.{_TENSOR_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TENSOR_NAMES[base]}.{kind}" if base in _TENSOR_NAMES else None


def iter_gguf_weights(reader, hf_config, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type, t.shape, dtype)
        if arch in ("llama", "mistral"):
            if name.endswith("self_attn.q_proj.weight"):
                w = _unpermute(w, hf_config.num_attention_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = _unpermute(w, hf_config.num_key_value_heads)
        yield name, w


# -- tokenizer ---------------------------------------------------------------

# llama.cpp pre-tokenizer names whose regex splits digits one by one before the
# GPT-2 byte-level split (SmolLM2, StarCoder, Refact share this tokenizer family)
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}


def gguf_tokenizer(reader):
    """A transformers fast tokenizer (byte-level BPE) and chat template from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                              fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tk.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens are matched whole, never split
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t in (3, 4)])

    def tok(key):
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = tok("tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, _field(reader, "tokenizer.ggml.bos_token_id"))])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=tok("tokenizer.ggml.eos_token_id"),
        unk_token=tok("tokenizer.ggml.unknown_token_id"),
        pad_token=tok("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"))
