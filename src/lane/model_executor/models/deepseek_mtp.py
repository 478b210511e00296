"""The MTP draft architectures (vLLM's and the seed's registry names): a checkpoint of a
DeepSeek model's multi-token-prediction layers alone, named as the draft with
``--speculative-config '{"method": "mtp", "model": DIR}'``.

lane runs MTP layers inside their target model (``model.mtp``: they share its embedding,
rope and, for V3, read its final hidden states), so a draft checkpoint's tensors go into the
target's MTP layers at load (``loader.get_model``), under the target's own names: V3 / V3.2 /
GLM-5 ``model.layers.{num_hidden_layers + i}.*``, V4 ``mtp.{i}.*``. These classes are what
the registry resolves such a checkpoint to: they say which targets they draft for, and a
draft served as a model of its own is refused with that advice.
"""
from __future__ import annotations

import torch.nn as nn


class DeepSeekMTPModel(nn.Module):
    """DeepSeek V3 / V3.2 (and GLM-5) MTP layers as a draft checkpoint."""
    draft_of = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

    def __init__(self, config, max_position: int | None = None) -> None:
        raise ValueError(refusal(type(self).__name__, self.draft_of))


class DeepSeekV4MTPModel(DeepSeekMTPModel):
    """DeepSeek V4's MTP block(s) (``mtp.{i}.*``) as a draft checkpoint."""
    draft_of = ("DeepseekV4ForCausalLM",)


def refusal(arch: str, targets: tuple[str, ...]) -> str:
    return (f"{arch} is a draft model (MTP layers alone): serve its target ({' / '.join(targets)}) and name this "
            f"checkpoint in --speculative-config '{{\"method\": \"mtp\", \"model\": \"DIR\"}}'")
