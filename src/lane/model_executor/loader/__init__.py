"""Model loading (seed step 4): resolve the class in the registry, build it, fill its weights."""
from __future__ import annotations

import contextlib
from collections import Counter
import logging
import os
import time

import torch
import torch.nn as nn
from tqdm import tqdm

from lane.config import ModelConfig
from lane.registry import ModelRegistry
from lane.tracing import Step, tracer

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _skip_random_init():
    """Every parameter is overwritten by the checkpoint: skip torch's random init
    (it costs seconds on a CPU for a 135M model)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, fn in saved:
            cls.reset_parameters = fn


def construct_model(model_cls: type[nn.Module], model_config: ModelConfig) -> nn.Module:
    """The implementation's modules in the model dtype, without random init (the weights
    are loaded after, or, on the meta device, never)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with _skip_random_init():
            return model_cls(model_config.hf_config, max_position=model_config.max_model_len)
    finally:
        torch.set_default_dtype(prev)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: dense parameters and quantized tensors (kept GGUF blocks,
    int8 weights and their scales; a tied embedding and LM head share theirs), each counted once."""
    seen: dict[int, int] = {}
    quantized = [t for m in model.modules() if hasattr(m, "quantized_tensors") for t in m.quantized_tensors()]
    for t in [*model.parameters(), *quantized]:
        if t is not None:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def int8_targets(model: nn.Module) -> list[nn.Module]:
    """What --quantization int8 / w8a8 quantizes: every quantizable Linear and every MoE expert
    stack, but in layers the forward never runs (a DeepSeek MTP layer)."""
    from lane.model_executor.layers.fused_moe import FusedMoE
    from lane.model_executor.layers.linear import Linear

    skip = tuple(getattr(model, "kv_cache_skip", ()))
    return [m for name, m in model.named_modules() if not (skip and name.startswith(skip))
            and ((isinstance(m, Linear) and m.quantizable) or isinstance(m, FusedMoE))]


def quantize_weights_int8(model: nn.Module, activations: bool) -> int:
    """--quantization int8 / w8a8 on a loaded model, layer by layer (the peak is one layer's
    copy). Returns how many modules were quantized."""
    targets = int8_targets(model)
    for m in targets:
        m.quantize_int8(activations)
    return len(targets)


def _keeps_gguf_blocks(model_config: ModelConfig) -> bool:
    """--quantization auto on the CPU: a GGUF's quantized weights stay in their blocks."""
    return model_config.quantization == "auto" and model_config.device_type.type == "cpu"


def planned_weight_bytes(model_config: ModelConfig, model: nn.Module) -> int:
    """The resident weight bytes ``get_model`` will report, from a weightless (meta) model and the
    checkpoint's tensor records: what `lane explain` shows before anything loads."""
    import math

    if model_config.gguf_file:
        from lane.model_executor.loader.gguf_loader import hf_tensor_name, keeps_blocks

        keep = _keeps_gguf_blocks(model_config)
        size = torch.empty(0, dtype=model_config.dtype).element_size()
        return sum(t.data.nbytes if keep and keeps_blocks(t) else math.prod(t.shape) * size
                   for t in model_config.gguf_reader.tensors if hf_tensor_name(t.name))
    dense = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    if model_config.quantization in ("int8", "w8a8"):
        per_row = 4 + 4 * (model_config.quantization == "w8a8")  # fp32 scale (and int32 sum) per channel
        for m in int8_targets(model):
            for p in m.parameters(recurse=False):
                if p.dim() >= 2:
                    dense[id(p)] = p.numel() + p.numel() // p.shape[-1] * per_row
    return sum(dense.values())


def _kinds(c: Counter) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(c.items()))


def get_model(model_config: ModelConfig, load_threads: int = 4, progress: bool = True,
              draft_dir: str | None = None) -> nn.Module:
    """Build the model its config names and load its weights (step 4); ``draft_dir``: an MTP draft
    checkpoint whose tensors go into the model's MTP layers, under the model's own names."""
    t_resolve = time.monotonic()
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.hf_config.architectures)
    if tracer.enabled:  # step 3
        tracer.record(Step.REGISTRY_RESOLVE, t_resolve, time.monotonic(), architecture=arch,
                      implementation=f"{model_cls.__module__}:{model_cls.__qualname__}")
    t_load = time.monotonic()
    t0 = time.perf_counter()
    model = construct_model(model_cls, model_config)
    loaded: set[str] = set()

    def consume(name: str, tensor: torch.Tensor) -> None:
        loaded.update(model.load_weights([(name, tensor)]))

    desc = f"Loading {model_config.short_name}"
    dequantized: Counter = Counter()  # GGUF quantized tensors dequantized at load, by kind
    notes_read = ""
    if model_config.gguf_file:
        from lane.model_executor.loader.gguf_loader import iter_gguf_weights

        reader = model_config.gguf_reader
        # one load_weights call for the whole stream: it maps the parameters once
        loaded.update(model.load_weights(tqdm(
            iter_gguf_weights(reader, model_config.hf_config, model_config.dtype,
                              keep_quantized=_keeps_gguf_blocks(model_config),
                              dequantized=dequantized),
            total=len(reader.tensors), desc=desc, disable=not progress, unit="tensor")))
    else:
        from lane.distributed.parallel_state import get_tp_group
        from lane.model_executor.loader.fp8 import Fp8Dequantizer, block_size_of, scale_suffixes_of
        from lane.model_executor.loader.safetensors_loader import (ReadCounter, count_tensors, load_safetensors,
                                                                   safetensors_files)

        files = safetensors_files(model_config.model_dir)
        cfg = model_config.hf_config
        fp8 = Fp8Dequantizer(consume, block_size_of(cfg), scale_suffixes_of(cfg))
        counter = ReadCounter()
        with tqdm(total=count_tensors(files), desc=desc, disable=not progress, unit="tensor") as bar:
            # over several ranks, each reads only its slices
            load_safetensors(files, fp8, load_threads, on_tensor=bar.update, lazy=get_tp_group().world_size > 1,
                             counter=counter)
        if draft_dir is not None:  # the draft's MTP layers, read as more of the same checkpoint
            draft = safetensors_files(draft_dir)
            with tqdm(total=count_tensors(draft), desc=f"Loading the MTP draft {os.path.basename(draft_dir)}",
                      disable=not progress, unit="tensor") as bar:
                load_safetensors(draft, fp8, load_threads, on_tensor=bar.update, counter=counter)
            files = files + draft
        fp8.finish()
        checkpoint = sum(os.path.getsize(f) for f in files)
        model.checkpoint_bytes_read = (counter.bytes, checkpoint)
        notes_read = f"; read {counter.bytes / 2**20:.1f} MiB of the checkpoint's {checkpoint / 2**20:.1f} MiB"
        if fp8.num_dequantized:
            logger.info("Dequantised %d fp8 block-quantised weights to %s", fp8.num_dequantized,
                        str(model_config.dtype).removeprefix("torch."))
    if hasattr(model, "finish_loading"):
        model.finish_loading(loaded)
    missing = [n for n, _ in model.named_parameters() if n not in loaded
               and not (n == "lm_head.weight" and getattr(model_config.hf_config, "tie_word_embeddings", False))]
    if missing:
        raise ValueError(f"checkpoint misses {len(missing)} tensors of {arch}, e.g. {missing[:3]}")
    if model_config.quantization in ("int8", "w8a8"):
        quantize_weights_int8(model, activations=model_config.quantization == "w8a8")
    model.eval()
    if tracer.enabled:  # step 4
        tracer.record(Step.LOADER_LOAD_WEIGHTS, t_load, time.monotonic(), tensors=len(loaded),
                      format="gguf" if model_config.gguf_file else "safetensors")
    kinds = [k for k in (getattr(m, "qkind", None) for m in model.modules()) if k]
    quantized = Counter(k for k in kinds if "+" not in k)
    mixed = Counter(k for k in kinds if "+" in k)  # a fused GGUF layer whose parts' kinds differ: dense
    resident = resident_weight_bytes(model)
    notes = []  # what is quantized, and which quantized kinds were not kept
    if quantized:
        notes.append(f"{quantized.total()} layers quantized: {_kinds(quantized)}")
    if mixed:
        notes.append(f"fused layers of mixed kinds dequantized to dense: {_kinds(mixed)}")
    if dequantized:
        notes.append(f"quantized tensors dequantized at load to "
                     f"{str(model_config.dtype).removeprefix('torch.')}: {_kinds(dequantized)}")
    logger.info("Loaded %s: architecture %s -> %s:%s in %.2f s; weights %.1f MiB resident%s%s",
                model_config.short_name, arch, model_cls.__module__, model_cls.__qualname__,
                time.perf_counter() - t0, resident / 2**20, notes_read, f" ({'; '.join(notes)})" if notes else "")
    return model
