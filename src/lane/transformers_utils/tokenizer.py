"""A model's tokenizer (seed step 10's tokenizer): transformers' AutoTokenizer for an
HF directory, or a fast byte-level BPE tokenizer built from a GGUF file's metadata.

No torch here: the GGUF tokenizer is transformers' PreTrainedTokenizerFast over a
``tokenizers`` model, which needs neither torch nor any lane model code, so the bench
client tokenises its prompts with it alone."""
from __future__ import annotations

from lane.transformers_utils.gguf_file import GGUFFile, gguf_field, open_gguf

# llama.cpp pre-tokenizer names whose regex splits digits one by one before the
# GPT-2 byte-level split (SmolLM2, StarCoder, Refact share this tokenizer family)
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}


def get_tokenizer(model_dir: str, gguf_file: str | None = None):
    """The tokenizer of an HF model directory, or of ``gguf_file`` when given."""
    if gguf_file:
        return gguf_tokenizer(open_gguf(gguf_file))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def gguf_tokenizer(reader: GGUFFile):
    """A transformers fast tokenizer (byte-level BPE) and chat template from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model = gguf_field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                              fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if gguf_field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tk.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens are matched whole, never split
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t in (3, 4)])

    def tok(key):
        i = gguf_field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = tok("tokenizer.ggml.bos_token_id")
    if gguf_field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, gguf_field(reader, "tokenizer.ggml.bos_token_id"))])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=tok("tokenizer.ggml.eos_token_id"),
        unk_token=tok("tokenizer.ggml.unknown_token_id"),
        pad_token=tok("tokenizer.ggml.padding_token_id"),
        chat_template=gguf_field(reader, "tokenizer.chat_template"))


class TokenStrings:
    """Each token's text as it reads inside a text (logprobs' token strings, as vLLM gives
    them: " Paris", not "Paris"). A SentencePiece / Metaspace decoder drops a word's leading
    space at the start of a text, so a token decoded alone loses it: each is decoded after a
    fixed anchor token, and the anchor's own text cut off. Cached per token id."""

    def __init__(self, tokenizer) -> None:
        self._backend = tokenizer.backend_tokenizer
        ids = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = ids[-1:] if len(ids) == 1 else []
        self._anchor_text = self._decode(self._anchor)
        self._cache: dict[int, str] = {}

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._decode([token_id])
            if self._anchor_text:
                joined = self._decode(self._anchor + [token_id])
                if joined.startswith(self._anchor_text):
                    s = joined[len(self._anchor_text):]
            self._cache[token_id] = s
        return s
