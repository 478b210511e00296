"""The built-in model table: architecture name -> "module:Class" (lazy)."""

_PKG = "lane.model_executor.models"

BUILTIN_MODELS: dict[str, str] = {
    # draft checkpoints of MTP layers (--speculative-config '{"method": "mtp", "model": DIR}')
    "DeepSeekMTPModel": f"{_PKG}.deepseek_mtp:DeepSeekMTPModel",
    "DeepSeekV4MTPModel": f"{_PKG}.deepseek_mtp:DeepSeekV4MTPModel",
    "DeepseekV3ForCausalLM": f"{_PKG}.deepseek_v2:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": f"{_PKG}.deepseek_v2:DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM": f"{_PKG}.deepseek_v4:DeepseekV4ForCausalLM",
    "GlmMoeDsaForCausalLM": f"{_PKG}.deepseek_v2:GlmMoeDsaForCausalLM",
    "KimiLinearForCausalLM": f"{_PKG}.kimi_linear:KimiLinearForCausalLM",
    "KimiK3ForCausalLM": f"{_PKG}.kimi_linear:KimiLinearForCausalLM",  # the seed's alias of the same class
    "LlamaForCausalLM": f"{_PKG}.llama:LlamaForCausalLM",
    "MistralForCausalLM": f"{_PKG}.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": f"{_PKG}.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": f"{_PKG}.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": f"{_PKG}.qwen3_moe:Qwen3MoeForCausalLM",
}

# Names the seed's registry lists that lane knows and refuses, with why (lane explain says so)
KNOWN_UNSUPPORTED: dict[str, str] = {
    "Qwen3DSparkModel": "the seed's Qwen3 DSpark draft model has no public reference implementation or checkpoint "
                        "format to check an implementation against; lane does not guess one",
}
