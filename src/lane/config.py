"""Engine configuration as dataclasses (vLLM's names where vLLM has them)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property

import torch

from lane import platform
from lane.kv_cache_interface import KV_CACHE_DTYPES
from lane.transformers_utils.config import get_config
from lane.transformers_utils.gguf_file import open_gguf
# DEFAULT_GGUF and default_model_path are imported from here too
from lane.transformers_utils.model_path import (DEFAULT_GGUF, default_model_path,  # noqa: F401
                                                resolve_model_path)
from lane.transformers_utils.tokenizer import get_tokenizer


QUANTIZATIONS = ("auto", "none", "int8", "w8a8")


@dataclass
class ModelConfig:
    model: str | None = None  # HF directory or .gguf file; None = embedded default
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str | None = None
    # auto: a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights stay in their blocks; none: dequantized at load to dtype;
    # int8 / w8a8: a safetensors checkpoint's linear weights quantized to int8 per channel at load
    # (w8a8 also quantizes the activations per token)
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        self.model, self.model_dir, self.gguf_file = resolve_model_path(self.model)
        if self.gguf_file and self.quantization in ("int8", "w8a8"):
            raise ValueError(f"--quantization {self.quantization} is for safetensors checkpoints; a GGUF runs "
                             f"its own quantization with --quantization auto (or none to dequantize it)")
        self.device_type = platform.check_device(self.device)
        if self.device_type.type != "cpu" and self.quantization in ("int8", "w8a8"):
            raise ValueError(f"--quantization {self.quantization} runs on lane's CPU kernels; on "
                             f"{self.device_type.type} use --quantization none")
        if self.device_type.type == "cpu":
            platform.cpu_isa()  # a bad LANE_CPU_ISA is refused here, by name
        self.dtype = platform.resolve_dtype(self.dtype, self.device_type)
        model_len = self.derived_max_model_len
        if self.max_model_len is None:
            self.max_model_len = model_len
        elif self.max_model_len > model_len:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"context length {model_len}")
        elif self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")

    @property
    def short_name(self) -> str:
        return os.path.basename(self.gguf_file or self.model_dir.rstrip("/"))

    @cached_property
    def gguf_reader(self):
        return open_gguf(self.gguf_file)

    @cached_property
    def hf_config(self):
        return get_config(self.model_dir, self.gguf_file)

    @property
    def block_size_multiple(self) -> int:
        """Compressed attention (DeepSeek V4) needs whole windows per block: the lcm of its rates."""
        import math

        rates = getattr(self.hf_config, "compress_rates", None) or {}
        return math.lcm(*[int(r) for r in rates.values() if r]) if rates else 1

    def resolve_block_size(self, requested: int | None) -> int:
        """--block-size, or by default 16 (rounded up to the model's multiple)."""
        multiple = self.block_size_multiple
        if requested is None:
            return -(-16 // multiple) * multiple
        if requested % multiple:
            raise ValueError(f"--block-size {requested} must be a multiple of {multiple} for this model "
                             f"(whole compression windows per block); leave it unset for the default")
        return requested

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def derived_max_model_len(self) -> int:
        cfg = self.hf_config
        n = getattr(cfg, "max_position_embeddings", None) or 2048
        window = getattr(cfg, "sliding_window", None)
        # full attention is exact only inside the window; past it we would need a
        # sliding-window cache (Mistral v0.1)
        if window and getattr(cfg, "use_sliding_window", True) and cfg.model_type == "mistral":
            n = min(n, window)
        return int(n)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        gen = os.path.join(self.model_dir, "generation_config.json")
        if not self.gguf_file and os.path.exists(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id", eos)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

    def get_tokenizer(self):
        return get_tokenizer(self.model_dir, self.gguf_file)


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: a quarter of free RAM, at most 4 GiB
    kv_cache_dtype: str = "auto"  # auto: the model dtype; int8 / fp8_e4m3: C8, 8 bits with scales

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"--kv-cache-memory-bytes must be > 0, got {self.kv_cache_memory_bytes}")

    def budget_bytes(self) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return min(platform.available_memory_bytes() // 4, 4 << 30)


SCHEDULING_POLICIES = ("decode-first", "prefill-first")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    # who gets the step's token budget first: running requests' decodes (vLLM's order), or
    # prompts (core/scheduler.py); LANE_SCHEDULER_POLICY sets it for lane serve and LLM
    policy: str = "decode-first"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {self.policy!r} (LANE_SCHEDULER_POLICY): expected one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")


def json_object_flag(value: "str | dict", flag: str, known: tuple[str, ...], example: str,
                     required: str | None = None) -> dict:
    """A JSON-object flag's value (the flag's text, or a dict given to ``LLM``), its keys checked by name."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict) or (required is not None and required not in value):
        raise ValueError(f"{flag} must be an object" + (f' with a "{required}"' if required else "")
                         + f", e.g. {example}")
    if unknown := sorted(set(value) - set(known)):
        raise ValueError(f"{flag}: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return value


EXECUTOR_BACKENDS = ("mp", "ray")
_EPLB_INTS = {"window_size": 1, "step_interval": 1, "num_redundant_experts": 0, "log_balancedness_interval": 1}
_EPLB_BOOLS = ("log_balancedness", "use_async")


@dataclass
class EplbConfig:
    """``--eplb-config`` (vLLM's fields): expert heat over the last ``window_size`` steps, a
    rearrangement every ``step_interval`` steps, ``num_redundant_experts`` extra slots per MoE
    layer, the balancedness logged every ``log_balancedness_interval`` steps, and ``use_async``:
    one layer's weights moved per step instead of all at once (no step stalls for the whole move)."""
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    use_async: bool = False

    def __post_init__(self) -> None:
        for key, least in _EPLB_INTS.items():
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"--eplb-config {key} must be an integer >= {least}, got {v!r}")
        for key in _EPLB_BOOLS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"--eplb-config {key} must be true or false, got {getattr(self, key)!r}")

    @classmethod
    def parse(cls, value: "str | dict | EplbConfig | None") -> "EplbConfig":
        """A JSON object (the flag's text), a dict (``LLM(eplb_config=...)``) or None (defaults)."""
        if value is None or isinstance(value, EplbConfig):
            return value or cls()
        return cls(**json_object_flag(value, "--eplb-config", (*_EPLB_INTS, *_EPLB_BOOLS),
                                      '{"window_size": 1000, "step_interval": 3000}'))


@dataclass
class ParallelConfig:
    """How one engine replica's model is split (vLLM's names). The world of a replica is its
    tensor-parallel ranks; with ``enable_expert_parallel`` the same ranks hold whole experts
    (ep = tp) instead of slices of every expert. Data-parallel replicas are separate engines."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None  # None: in-process at world 1, else mp
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    worker_timeout: float = 60.0  # seconds a step may take before the engine gives up on its workers
    rpc_secret_file: str | None = None  # signs the engine's messages to other machines (rpc_auth)
    enable_eplb: bool = False  # expert-parallel load balancing (eplb/)
    eplb_config: EplbConfig = field(default_factory=EplbConfig)
    # between attention and the FFN each tensor-parallel rank holds only its rows
    enable_sequence_parallel: bool = False
    # data-parallel attention with wide expert parallelism (dp > 1 with expert parallelism): this
    # replica's index, and where the dp x tp model ranks of every replica meet (set per engine
    # by the API server)
    data_parallel_rank: int = 0
    data_parallel_master_port: int = 0
    # DSA context parallelism: a prefill step's sparse attention split by rows over the tensor-parallel ranks
    enable_dsa_cp: bool = False

    def __post_init__(self) -> None:
        if self.enable_dsa_cp and self.tensor_parallel_size == 1:
            raise ValueError("--enable-dsa-cp splits a prefill chunk's indexer rows over the tensor-parallel ranks: "
                             "it needs --tensor-parallel-size > 1")
        if self.enable_sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-sequence-parallel splits each step's rows over the tensor-parallel ranks: "
                             "it needs --tensor-parallel-size > 1")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("--enable-eplb balances whole experts over the expert-parallel ranks: it requires "
                             "--enable-expert-parallel")
        if not self.enable_eplb and self.eplb_config.num_redundant_experts:
            raise ValueError("--eplb-config num_redundant_experts needs --enable-eplb")
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"--distributed-executor-backend {self.distributed_executor_backend!r} is not one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1:
            if self.tensor_parallel_size % self.nnodes:
                raise ValueError(f"--nnodes {self.nnodes} does not divide tensor_parallel_size "
                                 f"{self.tensor_parallel_size} (each node runs the same number of ranks)")
            if self.data_parallel_size > 1:
                raise ValueError("--nnodes > 1 spreads one replica's ranks over machines; with "
                                 "--data-parallel-size > 1 start one lane serve per replica")
            if self.distributed_executor_backend == "ray":
                raise ValueError("--nnodes is for the mp backend; with ray the cluster places the workers")
        if not 0 < self.master_port < 65534:
            raise ValueError(f"--master-port must be in [1, 65533], got {self.master_port}")
        if self.worker_timeout <= 0:
            raise ValueError(f"--worker-timeout must be > 0, got {self.worker_timeout}")

    @property
    def world_size(self) -> int:
        """This replica's ranks (its workers)."""
        return self.tensor_parallel_size

    @property
    def data_parallel_expert(self) -> bool:
        """Data-parallel attention with experts spread over every replica's ranks (vLLM's
        semantics of -dp N with --enable-expert-parallel): the replicas share one model world."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel

    @property
    def model_world_size(self) -> int:
        """The ranks of the torch.distributed world this replica's workers join."""
        return self.tensor_parallel_size * (self.data_parallel_size if self.data_parallel_expert else 1)

    @property
    def first_rank(self) -> int:
        """This replica's rank 0 in that world."""
        return self.data_parallel_rank * self.tensor_parallel_size if self.data_parallel_expert else 0

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def backend(self) -> str:
        """"uni" (the engine's own process), "mp" or "ray"."""
        if self.distributed_executor_backend is None:
            return "uni" if self.world_size == 1 else "mp"
        return self.distributed_executor_backend

    @property
    def ep_size(self) -> int:
        """Ranks the experts are spread over: every replica's ranks with data-parallel attention,
        the replica's ranks with expert parallelism, else 1."""
        return self.model_world_size if self.enable_expert_parallel else 1

    def check_model(self, hf_config) -> None:
        """Refuse a layout this model cannot be split into, with the numbers."""
        from lane.distributed.layout import check_eplb, check_layout

        redundant = self.eplb_config.num_redundant_experts if self.enable_eplb else 0
        check_layout(hf_config, self.tensor_parallel_size, self.enable_expert_parallel, redundant,
                     ep=self.ep_size if self.enable_expert_parallel else None)
        if self.enable_dsa_cp and not getattr(hf_config, "index_topk", None):
            raise ValueError("--enable-dsa-cp is for models with a lightning indexer (DeepSeek V3.2 / V4 sparse "
                             "layers); this one has no index_topk")
        if self.enable_eplb:
            check_eplb(hf_config, self.ep_size, redundant)


SPECULATIVE_METHODS = ("ngram", "mtp")
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


def has_delta_rule_state(hf_config) -> bool:
    """Whether the model keeps a linear-attention (delta-rule) state, which cannot step back a
    token: neither rejected drafts nor a PD hand-over (the decode side recomputes the last prompt
    token) can be served yet."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or [])


@dataclass
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's spelling): draft ``num_speculative_tokens`` tokens a
    step with n-gram prompt lookup or the model's own MTP layers, verify them in one pass."""
    method: str
    num_speculative_tokens: int | None = None  # MTP: the model's MTP depth when not given
    prompt_lookup_min: int | None = None  # n-gram: both 5 when neither is given (vLLM's default)
    prompt_lookup_max: int | None = None
    model: str | None = None  # MTP: a draft checkpoint of the MTP layers (else the target's own)

    def __post_init__(self) -> None:
        if self.method == "deepseek_mtp":  # vLLM's older name
            self.method = "mtp"
        if self.model is not None and self.method != "mtp":
            raise ValueError("--speculative-config: 'model' names an MTP draft checkpoint; method "
                             f"{self.method!r} drafts from the prompt")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config method {self.method!r} is not one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if self.method == "ngram":
            if k is None:
                raise ValueError("--speculative-config: method 'ngram' needs num_speculative_tokens")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            if not 1 <= lo <= hi:
                raise ValueError(f"--speculative-config: need 1 <= prompt_lookup_min ({lo}) <= "
                                 f"prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if k is not None and not 1 <= k <= 16:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be in [1, 16], got {k}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON object (the flag's text) or a dict (``LLM(speculative_config=...)``)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls(**json_object_flag(value, "--speculative-config", _SPEC_KEYS,
                                      '{"method": "ngram", "num_speculative_tokens": 3}', required="method"))

    def check_model(self, hf_config, architecture: str) -> None:
        """Refuse a method the model cannot serve, by name; fill in MTP's default depth. A draft
        checkpoint (``model``) must draft for this architecture, at its width; its MTP depth
        becomes the target's (the target builds that many MTP layers, which it then loads)."""
        if has_delta_rule_state(hf_config):
            raise ValueError(f"--speculative-config: {architecture}'s delta-rule state cannot step back from "
                             f"rejected drafts yet; serve it without speculation")
        if self.method != "mtp":
            return
        if self.model is not None:
            hf_config.num_nextn_predict_layers = self._draft_depth(hf_config, architecture)
        n = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
        if not n:
            raise ValueError(f"--speculative-config method 'mtp' needs a model with MTP layers: {architecture} "
                             f"has num_nextn_predict_layers=0 (use method 'ngram')")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = n

    def _draft_depth(self, target, architecture: str) -> int:
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--speculative-config model {self.model!r}: no config.json there (an MTP draft "
                             f"checkpoint directory: config.json and *.safetensors)")
        with open(path) as f:
            draft = json.load(f)
        archs = draft.get("architectures") or []
        from lane.registry import ModelRegistry

        draft_of = {a for arch in archs if ModelRegistry.get_entry(arch)
                    for a in getattr(ModelRegistry.model_class(arch), "draft_of", ())}
        if architecture not in draft_of and architecture not in archs:
            raise ValueError(f"--speculative-config model {self.model!r}: its architectures {archs} do not draft "
                             f"for {architecture}")
        for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
            if draft.get(key) != getattr(target, key, None):
                raise ValueError(f"--speculative-config model {self.model!r}: {key} {draft.get(key)} differs from "
                                 f"the target's {getattr(target, key, None)}")
        n = int(draft.get("num_nextn_predict_layers") or 0)
        if n < 1:
            raise ValueError(f"--speculative-config model {self.model!r}: num_nextn_predict_layers is {n}")
        return n

    @property
    def num_lookahead_slots(self) -> int:
        """Slots past the verified tokens a step writes: MTP's drafting runs its layer at the
        draft positions (n-gram writes none)."""
        return self.num_speculative_tokens if self.method == "mtp" else 0


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KV_KEYS = ("kv_connector", "kv_role", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "engine_id",
            "kv_connector_extra_config")


@dataclass
class KVTransferConfig:
    """``--kv-transfer-config`` (vLLM's fields): which connector moves KV between a prefill and a
    decode engine, this engine's role, and where the connector listens or stores."""
    kv_connector: str
    kv_role: str = "kv_both"
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from lane.kv_transfer.factory import CONNECTORS

        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config kv_connector {self.kv_connector!r} is not one of "
                             f"{', '.join(CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config kv_role {self.kv_role!r} is not one of {', '.join(KV_ROLES)}")
        for key, least in (("kv_parallel_size", 1), ("kv_port", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"--kv-transfer-config {key} must be an integer >= {least}, got {v!r}")
        if self.kv_port > 65535:
            raise ValueError(f"--kv-transfer-config kv_port must be <= 65535, got {self.kv_port}")
        if self.kv_rank is not None and (isinstance(self.kv_rank, bool) or not isinstance(self.kv_rank, int)
                                         or self.kv_rank < 0):
            raise ValueError(f"--kv-transfer-config kv_rank must be an integer >= 0, got {self.kv_rank!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("--kv-transfer-config kv_connector_extra_config must be an object")
        if self.engine_id is None:
            import uuid

            self.engine_id = uuid.uuid4().hex

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """A JSON object (the flag's text) or a dict (``LLM(kv_transfer_config=...)``)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return cls(**json_object_flag(value, "--kv-transfer-config", _KV_KEYS,
                                      '{"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
                                      '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}',
                                      required="kv_connector"))


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    threads: int | None = None
    load_threads: int = 4
    kv_transfer_config: KVTransferConfig | None = None
    show_progress: bool = True
    engine_args: "EngineArgs | None" = None  # what made it: worker processes make theirs from it

    def __post_init__(self) -> None:
        from lane.registry import ModelRegistry

        ModelRegistry.check_servable(self.model_config.architectures or [])  # a draft, a known refusal
        self.scheduler_config.max_model_len = self.model_config.max_model_len
        self.parallel_config.check_model(self.model_config.hf_config)
        if self.speculative_config is not None:
            self.speculative_config.check_model(self.model_config.hf_config,
                                                (self.model_config.architectures or ["this model"])[0])
        if self.kv_transfer_config is not None and has_delta_rule_state(self.model_config.hf_config):
            raise ValueError(f"--kv-transfer-config: {(self.model_config.architectures or ['this model'])[0]}'s "
                             f"delta-rule state cannot be handed over yet (the decode side recomputes the last prompt "
                             f"token, and this state cannot step back before it); serve it on one instance")
        if (self.kv_transfer_config is not None and self.model_config.block_size_multiple > 1
                and not self.cache_config.enable_prefix_caching):
            raise ValueError("--kv-transfer-config with compressed attention (DeepSeek V4) needs prefix caching: "
                             "a request resumes from transferred blocks through their block-edge snapshots, which "
                             "only a cache with prefix caching keeps (drop --no-enable-prefix-caching)")


class EngineArgsError(ValueError):
    """A setting the engine cannot run with (a bad flag): reported as a usage error."""


@dataclass
class EngineArgs:
    """The user-facing engine settings (flags of ``lane generate`` / ``lane serve``, keyword
    arguments of ``LLM``): plain values, so they cross a process boundary as they are."""
    model: str | None = None
    dtype: str = "auto"
    block_size: int | None = None  # None: 16, or the model's multiple of its compression rates
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    threads: int | None = None
    show_progress: bool = True
    quantization: str = "auto"
    enable_tracing: bool = False  # record the seed's steps as spans (lane serve --trace)
    trace_layers: bool = False  # one span per layer, not per forward
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    worker_timeout: float = 60.0
    rpc_secret_file: str | None = None
    enable_eplb: bool = False
    eplb_config: dict | str | None = None  # JSON text or a dict (EplbConfig's fields)
    enable_sequence_parallel: bool = False
    enable_dsa_cp: bool = False
    data_parallel_rank: int = 0  # set per engine by the API server (data-parallel attention)
    data_parallel_master_port: int = 0
    data_parallel_sync_path: str | None = None  # the engines' lock-step segment (engine/dp_coordinator.py)
    speculative_config: dict | str | None = None  # JSON text or a dict (SpeculativeConfig's fields)
    kv_transfer_config: dict | str | None = None  # JSON text or a dict (KVTransferConfig's fields)
    device: str | None = None  # None / "auto": the CPU (the only device lane runs on yet)
    kv_cache_dtype: str = "auto"  # C8: int8 / fp8_e4m3

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, self.enable_expert_parallel,
                              self.distributed_executor_backend, self.nnodes, self.node_rank, self.master_addr,
                              self.master_port, self.worker_timeout, self.rpc_secret_file, self.enable_eplb,
                              EplbConfig.parse(self.eplb_config),
                              enable_sequence_parallel=self.enable_sequence_parallel,
                              data_parallel_rank=self.data_parallel_rank,
                              data_parallel_master_port=self.data_parallel_master_port,
                              enable_dsa_cp=self.enable_dsa_cp)

    def create_model_config(self) -> ModelConfig:
        return ModelConfig(self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
                           device=self.device, quantization=self.quantization)

    def create_engine_config(self, model_config: ModelConfig | None = None) -> EngineConfig:
        model_config = model_config or self.create_model_config()
        block_size = self.block_size
        if block_size is not None and block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        return EngineConfig(
            model_config,
            CacheConfig(model_config.resolve_block_size(block_size), self.enable_prefix_caching,
                        self.kv_cache_memory_bytes, self.kv_cache_dtype),
            SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                            policy=os.environ.get("LANE_SCHEDULER_POLICY", "").strip() or "decode-first"),
            self.create_parallel_config(), SpeculativeConfig.parse(self.speculative_config), threads=self.threads,
            show_progress=self.show_progress, engine_args=self,
            kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config))
