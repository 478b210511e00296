"""The built-in model table: architecture name -> "module:Class" (lazy)."""

_PKG = "lane.model_executor.models"

BUILTIN_MODELS: dict[str, str] = {
    "DeepseekV3ForCausalLM": f"{_PKG}.deepseek_v2:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": f"{_PKG}.deepseek_v2:DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM": f"{_PKG}.deepseek_v4:DeepseekV4ForCausalLM",
    "LlamaForCausalLM": f"{_PKG}.llama:LlamaForCausalLM",
    "MistralForCausalLM": f"{_PKG}.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": f"{_PKG}.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": f"{_PKG}.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": f"{_PKG}.qwen3_moe:Qwen3MoeForCausalLM",
}
