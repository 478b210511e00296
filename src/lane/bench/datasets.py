"""Benchmark datasets (vllm bench serve's names): random, sharegpt, prefix, jsonl.
Files come from the user; nothing is downloaded."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt: str
    prompt_token_ids: list[int]  # as the tokenizer encodes the prompt (for lengths and shared prefixes)
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


class BenchTokenizer:
    """encode / decode through a local tokenizer (an HF directory or a GGUF file). Read
    with transformers_utils alone: the bench client loads neither lane.config nor torch
    (a GGUF's tokenizer needs neither; an HF directory's AutoTokenizer may import torch)."""

    def __init__(self, path: str | None) -> None:
        from lane.transformers_utils.model_path import resolve_model_path
        from lane.transformers_utils.tokenizer import get_tokenizer

        _, model_dir, gguf_file = resolve_model_path(path)
        self.tok = get_tokenizer(model_dir, gguf_file)
        self.vocab_size = len(self.tok)
        self.name = path or "the embedded default model"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class ServerTokenizer:
    """The server's own tokenizer, through its /tokenize and /detokenize routes (lane, vLLM)."""

    def __init__(self, base_url: str, model: str | None, headers: dict[str, str]) -> None:
        import httpx2

        self.http = httpx2.Client(base_url=base_url, headers=headers, timeout=60)
        self.model = model
        self.name = f"{base_url}/tokenize"
        self.encode("probe")  # raises if the server has no /tokenize
        self.vocab_size = self._find_vocab_size()

    def encode(self, text: str) -> list[int]:
        r = self.http.post("/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        r = self.http.post("/detokenize", json={"model": self.model, "tokens": ids})
        r.raise_for_status()
        return r.json()["prompt"]

    def _find_vocab_size(self) -> int:
        """The routes do not say the vocabulary size: find the first id /detokenize refuses."""
        lo, hi = 1, 1 << 21  # ids below lo decode; hi is refused (checked below)
        if self._decodes(hi):
            raise ValueError("the server's /detokenize accepts any id; its vocabulary size is unknown")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._decodes(mid) else (lo, mid)
        return hi

    def _decodes(self, token_id: int) -> bool:
        r = self.http.post("/detokenize", json={"model": self.model, "tokens": [token_id]})
        return r.status_code == 200


def exact_length_text(tok: BenchTokenizer, ids: list[int], rounds: int = 8) -> tuple[str, list[int]]:
    """Text that re-tokenises to len(ids) tokens, and its token ids: decoding then encoding
    random ids can merge or split tokens, so trim or pad and try again (as vLLM's random
    dataset does)."""
    target = len(ids)
    text = tok.decode(ids)
    for _ in range(rounds):
        again = tok.encode(text)
        if len(again) == target:
            return text, again
        if len(again) > target:
            again = again[:target]
        else:
            again = again + ids[: target - len(again)]
        text = tok.decode(again)
    return text, tok.encode(text)


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # skip the low ids: special and byte tokens decode to odd text
    return [rng.randrange(min(1000, vocab_size // 2), vocab_size) for _ in range(n)]


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(max(lo, 1), max(hi, 1)))


def random_dataset(tok: BenchTokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float, rng: random.Random) -> list[SampleRequest]:
    out = []
    for _ in range(num_prompts):
        n_in = _lengths(rng, input_len, range_ratio)
        text, ids = exact_length_text(tok, random_token_ids(rng, n_in, tok.vocab_size))
        out.append(SampleRequest(text, ids, _lengths(rng, output_len, range_ratio)))
    return out


def prefix_dataset(tok: BenchTokenizer, num_prompts: int, num_groups: int, prefix_len: int,
                   suffix_len: int, output_len: int, rng: random.Random) -> list[SampleRequest]:
    """num_groups groups of prompts; the prompts of a group share their first prefix_len
    tokens, then differ. Requests are interleaved across groups."""
    prefixes = [exact_length_text(tok, random_token_ids(rng, prefix_len, tok.vocab_size))[0]
                for _ in range(num_groups)]
    out = []
    for i in range(num_prompts):
        prefix = prefixes[i % num_groups]
        suffix = exact_length_text(tok, random_token_ids(rng, suffix_len, tok.vocab_size))[0]
        text = prefix + suffix
        out.append(SampleRequest(text, tok.encode(text), output_len))
    return out


def sharegpt_dataset(tok: BenchTokenizer, path: str, num_prompts: int, output_len: int | None,
                     rng: random.Random) -> list[SampleRequest]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}].
    The first human turn is the prompt; the reply's length is the output length unless given."""
    with open(path) as f:
        data = json.load(f)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if len(c.get("conversations", [])) >= 2]
    if not pairs:
        raise ValueError(f"{path} has no conversation with two turns")
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        ids = tok.encode(prompt)
        n_out = output_len or len(tok.encode(reply))
        if len(ids) < 4 or n_out < 4:  # vllm bench's filter: too short to measure
            continue
        out.append(SampleRequest(prompt, ids, n_out))
        if len(out) == num_prompts:
            break
    return out


def jsonl_dataset(tok: BenchTokenizer, path: str, num_prompts: int, output_len: int | None
                  ) -> list[SampleRequest]:
    """One JSON object per line: {"prompt": str, "max_tokens": int (optional)}."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"max_tokens\": ...}}") from None
            n_out = int(row.get("max_tokens") or output_len or 128)
            out.append(SampleRequest(prompt, tok.encode(prompt), n_out))
            if len(out) == num_prompts:
                break
    return out
