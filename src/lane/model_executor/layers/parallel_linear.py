"""Tensor-parallel layers (vLLM's ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``QKVParallelLinear`` / ``VocabParallelEmbedding`` / ``ParallelLMHead``), on lane's
``Linear``: each rank builds only its slice and loads only its slice of every checkpoint
tensor (``shard``: dense tensors and GGUF blocks alike; blocks split on block boundaries).

- Column parallel: output rows split (each fused part on its own: q | k | v, gate | up);
  KV heads fewer than ranks are replicated (rank r holds KV head r // (tp / kv)).
- Row parallel: input columns split; the partial products are summed by an all-reduce
  (seed step 28 after attention, 31 after the FFN), its bias counted once (rank 0's).
- Sequence parallel (``--enable-sequence-parallel``): those all-reduces become reduce-scatters
  that leave each rank only its rows (the embedding's is step 22, "each rank keeps its rows");
  norms and mHC run on those rows, and ``gather_rows`` all-gathers them where a layer needs
  every row (attention, the FFN, the final hidden states).
- Vocabulary parallel: rank r holds vocabulary rows [r * s, (r + 1) * s), s = ceil(V / tp);
  an embedding lookup sums the ranks' rows (each is zero outside its range), the LM head's
  logits are gathered from the shards (step 33).

At one rank every layer is the plain ``Linear`` / ``VocabEmbedding`` it extends.
"""
from __future__ import annotations

import torch

from lane import tracing
from lane.distributed.parallel_state import GroupCoordinator, get_tp_group, sequence_parallel_splits
from lane.model_executor.layers.linear import Linear
from lane.model_executor.layers.vocab_embedding import VocabEmbedding
from lane.tracing import Step


def _check_rows(tensor, dim: int, want: int, what: str) -> None:
    """A checkpoint tensor must be the whole weight (or fused part) before a rank takes its slice."""
    if tensor.shape[dim] != want:
        raise ValueError(f"checkpoint {what}: {tensor.shape[dim]} along dim {dim}, the model expects {want}")


def reduce_partial(tp: GroupCoordinator, y: torch.Tensor, step: int, compute_step: int | None = None) -> torch.Tensor:
    """All-reduce a row-parallel partial sum at ``step`` (under sequence parallelism: reduce-scatter
    it, this rank's rows only); ``compute_step``: the step whose time ends here (the FFN's, before
    its reduce), so the trace splits compute from the collective."""
    if tp.world_size == 1:
        return y
    mark = tracing.forward_mark()
    if compute_step is not None:
        mark(compute_step)
    splits = sequence_parallel_splits()
    y = tp.all_reduce(y, step) if splits is None else tp.reduce_scatter(y, splits, step)
    if compute_step is not None:
        mark(step)
    return y


def gather_rows(x: torch.Tensor, compute_step: int | None = None) -> torch.Tensor:
    """Under sequence parallelism, every rank's rows of x all-gathered (step 22) for a layer
    that needs them all; otherwise x. ``compute_step``: the step whose time ends here."""
    splits = sequence_parallel_splits()
    if splits is None:
        return x
    mark = tracing.forward_mark()
    if compute_step is not None:
        mark(compute_step)
    x = get_tp_group().all_gather_rows(x, splits, Step.COMM_SP_SCATTER)
    mark(Step.COMM_SP_SCATTER)
    return x


def own_rows(x: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism, this rank's rows of a tensor every rank holds whole (no
    communication); otherwise x."""
    splits = sequence_parallel_splits()
    if splits is None:
        return x
    r = get_tp_group().rank_in_group
    return x.narrow(0, sum(splits[:r]), splits[r])


class ColumnParallelLinear(Linear):
    """Output rows split by rank. ``output_sizes``: the full sizes of the fused parts; ``part_slices``
    overrides a part's (start, length) on this rank (a replicated KV head)."""

    def __init__(self, in_features: int, output_sizes: int | list[int], bias: bool = False,
                 quantizable: bool | None = None, dtype=None, tp: GroupCoordinator | None = None,
                 part_slices: list[tuple[int, int]] | None = None) -> None:
        tp = tp or get_tp_group()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        r, n = tp.rank_in_group, tp.world_size
        self.output_sizes = sizes
        self.part_slices = part_slices or [(r * (s // n), s // n) for s in sizes]
        super().__init__(in_features, sum(length for _, length in self.part_slices), bias, dtype=dtype,
                         quantizable=quantizable)
        self.tp_size = n

    def shard(self, tensor, part: int | None, attr: str = "weight"):
        """(this rank's rows of a checkpoint tensor, where they go in the local weight)."""
        if part is None and len(self.output_sizes) > 1 and self.tp_size == 1:
            return tensor, 0  # the fused weight whole: it goes in as it is
        part = part or 0
        _check_rows(tensor, 0, self.output_sizes[part], f"part {part} of a {len(self.output_sizes)}-part layer")
        start, length = self.part_slices[part]
        offset = sum(length for _, length in self.part_slices[:part])
        return (tensor if self.tp_size == 1 else tensor.narrow(0, start, length)), offset


class RowParallelLinear(Linear):
    """Input columns split by rank; the output all-reduced (``reduce``; False where the caller
    sums several partials first: a MoE's routed and shared experts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_step: int = Step.COMM_ATTN_REDUCE,
                 compute_step: int | None = None, reduce: bool = True, quantizable: bool | None = None,
                 dtype=None, tp: GroupCoordinator | None = None) -> None:
        self.tp = tp or get_tp_group()
        n = self.tp.world_size
        super().__init__(in_features // n, out_features, bias, dtype=dtype, quantizable=quantizable)
        self.reduce, self.reduce_step, self.compute_step = reduce, reduce_step, compute_step
        self.full_in_features = in_features

    def shard(self, tensor, part: int | None = None, attr: str = "weight"):
        if self.tp.world_size == 1:
            return tensor, 0
        if attr == "bias":  # summed over ranks: rank 0 adds it
            return (tensor if self.tp.rank_in_group == 0 else torch.zeros_like(tensor)), 0
        _check_rows(tensor, 1, self.full_in_features, "input features")
        k = self.in_features
        return tensor.narrow(1, self.tp.rank_in_group * k, k), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return reduce_partial(self.tp, y, self.reduce_step, self.compute_step) if self.reduce else y


def qkv_parallel_linear(hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                        tp: GroupCoordinator | None = None) -> ColumnParallelLinear:
    """Q, K and V fused, split by heads; KV heads fewer than ranks replicated."""
    tp = tp or get_tp_group()
    r, n = tp.rank_in_group, tp.world_size
    q = num_heads // n * head_dim
    if num_kv_heads >= n:
        kv_start, kv_len = r * (num_kv_heads // n) * head_dim, num_kv_heads // n * head_dim
    else:
        kv_start, kv_len = r // (n // num_kv_heads) * head_dim, head_dim
    return ColumnParallelLinear(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                                bias, tp=tp, part_slices=[(r * q, q), (kv_start, kv_len), (kv_start, kv_len)])


def local_kv_heads(num_kv_heads: int, tp: GroupCoordinator | None = None) -> int:
    n = (tp or get_tp_group()).world_size
    return max(1, num_kv_heads // n)


def vocab_range(vocab_size: int, tp: GroupCoordinator) -> tuple[int, int]:
    s = -(-vocab_size // tp.world_size)
    start = min(vocab_size, tp.rank_in_group * s)
    return start, min(vocab_size, start + s)


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: GroupCoordinator | None = None) -> None:
        self.tp = tp or get_tp_group()
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.tp)
        super().__init__(self.vocab_end - self.vocab_start, embedding_dim)
        self.full_vocab_size = num_embeddings

    def shard(self, tensor, part: int | None = None, attr: str = "weight"):
        if self.tp.world_size == 1:
            return tensor, 0
        _check_rows(tensor, 0, self.full_vocab_size, "vocabulary rows")
        return tensor.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start), 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = super().forward(torch.where(inside, input_ids - self.vocab_start, 0))
        out.masked_fill_(~inside[..., None], 0)
        splits = sequence_parallel_splits()
        if splits is not None:  # step 22: the scatter that leaves each rank its rows
            tracing.forward_mark()(Step.OPS_INPUT_NORM)
            out = self.tp.reduce_scatter(out, splits, Step.COMM_SP_SCATTER)
            tracing.forward_mark()(Step.COMM_SP_SCATTER, rows_per_rank="/".join(map(str, splits)))
            return out
        return self.tp.all_reduce(out, Step.OPS_INPUT_NORM)


class ParallelLMHead(Linear):
    """The LM head on this rank's vocabulary rows; forward returns the whole vocabulary's
    logits on every rank (each shard padded to ceil(V / tp) for the gather, then trimmed)."""

    def __init__(self, hidden: int, vocab_size: int, tp: GroupCoordinator | None = None) -> None:
        self.tp = tp or get_tp_group()
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, self.tp)
        super().__init__(hidden, self.vocab_end - self.vocab_start, bias=False, quantizable=False)
        self.full_vocab_size = vocab_size

    shard = VocabParallelEmbedding.shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp.world_size == 1:
            return logits
        tracing.forward_mark()(Step.MODEL_LM_HEAD)
        pad = -(-self.full_vocab_size // self.tp.world_size) - logits.shape[-1]
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        out = self.tp.all_gather(logits, Step.COMM_LOGITS_GATHER)[..., :self.full_vocab_size]
        tracing.forward_mark()(Step.COMM_LOGITS_GATHER)
        return out


def shard_param(param: torch.Tensor, tensor: torch.Tensor, dim: int = 0,
                tp: GroupCoordinator | None = None) -> torch.Tensor:
    """A checkpoint tensor split along ``dim`` to this rank's slice (a plain parameter split by
    heads, e.g. V4's attention sinks), checked against the parameter's shape."""
    tp = tp or get_tp_group()
    if tp.world_size > 1 and tensor.shape[dim] != param.shape[dim]:
        n = tensor.shape[dim] // tp.world_size
        tensor = tensor.narrow(dim, tp.rank_in_group * n, n)
    return tensor
