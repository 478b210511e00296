"""MTP drafting (seed step 45, vLLM's ``MTPProposer`` / ``EagleProposer``): the model's own
multi-token-prediction layers propose the next tokens from its hidden states.

Each step, after the target's tokens are known:
1. the MTP layer runs at every position the target computed and kept, reading the target's
   hidden state there (``model.mtp_source``) and the token that followed: this fills the
   MTP layer's own KV cache, and its last row per request gives the first draft;
2. for k > 1 it runs again, one position further each time, on its own output and its last
   draft (layer ``j % num_mtp_layers``), in slots the scheduler allocated ahead (lookahead).
Slots it wrote past the kept tokens are rewritten by step 1 of a later step before any query
reads them. Greedy requests draft the argmax; the others sample from the MTP distribution
(softmax at their temperature) and keep it, for the rejection sampler's min(1, p / q).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from lane.attention.metadata import BatchLayout, CommonAttentionMetadata, set_forward_context
from lane.model_executor.layers.sampler import inverse_cdf
from lane.worker.input_batch import ScheduledRequest


@dataclass
class MtpRows:
    """One request's rows of the MTP's first pass."""
    req: ScheduledRequest
    first_row: int  # in the target's flattened batch
    num_rows: int  # positions computed and kept this step
    num_drafts: int  # drafts it wants (0: a prefill chunk that does not sample, or no room)


class MtpProposer:
    def __init__(self, model: nn.Module, num_speculative_tokens: int,
                 build_metadata: Callable[[CommonAttentionMetadata, list], list],
                 rows_as_decodes: Callable[[], bool]) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.num_layers = model.num_mtp_layers
        self.build_metadata = build_metadata
        self.rows_as_decodes = rows_as_decodes  # whether the caches let a request's rows be decode rows

    def _decode_shaped(self, num_rows: int) -> bool:
        """One row, or a verify step's few kept rows where the caches let rows be decode rows."""
        return num_rows == 1 or (num_rows <= self.k + 1 and self.rows_as_decodes())

    def _run(self, rows: list[tuple[ScheduledRequest, list[int], int]], source: torch.Tensor,
             layer: int) -> torch.Tensor:
        """The MTP layer over each request's (next tokens, first position) rows, decode-shaped
        ones first as the metadata wants; source rows in that order too."""
        ids: list[int] = []
        positions: list[int] = []
        layout = BatchLayout()
        for r, nxt, p0 in rows:
            layout.add(r.state.block_ids, p0, len(nxt), self._decode_shaped(len(nxt)))
            ids.extend(nxt)
            positions.extend(range(p0, p0 + len(nxt)))
        md = self.build_metadata(layout.common(), layout.block_ids)
        with set_forward_context(md):
            return self.model.mtp_forward(torch.tensor(ids, dtype=torch.long),
                                          torch.tensor(positions, dtype=torch.long), source, layer)

    def _draft(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, layer: int
               ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft per request from the MTP's hidden rows: argmax, or a sample (and its q)."""
        logits = self.model.mtp_logits(hidden, layer).float()
        tokens = logits.argmax(-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        for b, s in enumerate(reqs):
            sp = s.state.sampling_params
            if not sp.greedy:
                q = torch.softmax(logits[b] / sp.temperature, dim=-1)
                tokens[b] = int(inverse_cdf(q[None], 1.0 - torch.rand(1, 1, generator=s.state.generator)))
                probs[b] = q
        return tokens, probs

    @torch.inference_mode()
    def propose(self, plan: list[MtpRows], target_hidden: torch.Tensor
                ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Req id -> (drafts, their MTP probabilities [n, V] or None when greedy)."""
        plan = sorted((p for p in plan if p.num_rows), key=lambda p: not self._decode_shaped(p.num_rows))
        if not plan:
            return {}
        source = self.model.mtp_source(target_hidden)
        index = torch.cat([torch.arange(p.first_row, p.first_row + p.num_rows) for p in plan])
        rows = []
        for p in plan:
            st, nc = p.req.state, p.req.state.num_computed_tokens
            rows.append((p.req, st.token_ids[nc + 1:nc + 1 + p.num_rows], nc))
        h = self._run(rows, source[index], 0)  # step 1: every kept position
        drafting = [i for i, p in enumerate(plan) if p.num_drafts]
        if not drafting:
            return {}
        ends = torch.tensor([sum(p.num_rows for p in plan[:i + 1]) - 1 for i in drafting])
        reqs = [plan[i].req for i in drafting]
        want = [plan[i].num_drafts for i in drafting]
        pos = [plan[i].req.state.num_computed_tokens + plan[i].num_rows - 1 for i in drafting]
        h = h[ends]
        out: dict[str, tuple[list[int], list]] = {r.state.req_id: ([], []) for r in reqs}
        for j in range(self.k):
            layer = j % self.num_layers
            toks, probs = self._draft(reqs, h, layer)
            for r, t, q in zip(reqs, toks, probs):
                out[r.state.req_id][0].append(t)
                out[r.state.req_id][1].append(q)
            live = [b for b in range(len(reqs)) if want[b] > j + 1]
            if not live:
                break
            # step 2: one position on, from its own output and its last draft
            reqs, want = [reqs[b] for b in live], [want[b] for b in live]
            pos = [pos[b] + 1 for b in live]
            h = self._run([(r, [toks[b]], p) for r, b, p in zip(reqs, live, pos)], h[live],
                          (j + 1) % self.num_layers)
        return {rid: (toks, None if q[0] is None else torch.stack(q)) for rid, (toks, q) in out.items()}
