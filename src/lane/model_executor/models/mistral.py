"""Mistral: the Llama block. A sliding window, when the config has one, caps
max_model_len at the window (see config.py), so full attention stays exact."""
from lane.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
