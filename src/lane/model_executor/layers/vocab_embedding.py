"""The token embedding, which can keep a GGUF's quantized rows (a kind of
cpu_kernels.GGML_KINDS) in their blocks: a lookup dequantizes only the rows it reads (a
step reads a few), and a tied LM head multiplies by the same blocks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels


class VocabEmbedding(nn.Embedding):
    qweight: torch.Tensor | None = None  # uint8 [vocab, row bytes]
    qkind: str | None = None
    out_dtype: torch.dtype | None = None  # what lookups of quantized rows return
    qx8 = False  # the blocks are a tied LM head's, repacked 8 rows interleaved (cpu_kernels.repack_x8)

    def load_quantized(self, kind: str, blocks: torch.Tensor) -> None:
        self.out_dtype = self.weight.dtype
        self.qweight, self.qkind = blocks, kind
        self.weight = None

    def quantized_tensors(self) -> list[torch.Tensor | None]:
        return [self.qweight]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(input_ids, self.weight)
        if self.qx8:
            out = cpu_kernels.dequant_x8_rows(self.qweight, self.qkind, input_ids, self.embedding_dim, self.out_dtype)
            return out.view(*input_ids.shape, self.embedding_dim)
        rows = self.qweight.index_select(0, input_ids.reshape(-1))
        out = cpu_kernels.dequant_ggml(rows.numpy(), self.qkind, self.out_dtype)
        return out.view(*input_ids.shape, self.embedding_dim)
