"""Incremental detokenisation and stop strings (seed steps 38, 50).

Text is produced with the tokenizers library's DecodeStream, which holds back
incomplete UTF-8 sequences, so a Chinese character or an emoji split over
several byte tokens never comes out broken. Stop strings are matched on the
text; while streaming, the last len(longest stop) - 1 characters are held back
so a stop string never leaks into what was already sent.

The stream is primed with the prompt's last tokens: SentencePiece / Metaspace
decoders (Llama 2, Mistral, many GGUFs) drop a word's leading space at the start
of a text, so the first output token decoded alone would lose its space.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

PRIME_TOKENS = 6  # prompt tokens the stream sees first; enough to start on a whole character


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0,
                 prompt_token_ids: list[int] | None = None) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(self._prompt_tail(prompt_token_ids or []), skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings count only in text after this many tokens (vLLM)
        self.num_tokens = 0
        self.hold_back = max((len(s) for s in stop), default=1) - 1 if not include_stop_str_in_output else 0
        self.output_text = ""
        self._sent = 0  # characters already handed out as deltas

    def _prompt_tail(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, from a whole character on; none if the prompt ends
        inside a character (the output would complete it: no clean place to start)."""
        tail = prompt_token_ids[-PRIME_TOKENS:]
        while tail:
            text = self._backend.decode(tail, skip_special_tokens=self._skip_special)
            if text.endswith("\ufffd"):
                return []
            if not text.startswith("\ufffd"):
                return tail
            tail = tail[1:]
        return []

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:  # the primed text is not a prefix of the new text: go on unprimed
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            return self._stream.step(self._backend, token_id)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one now appears in the text."""
        for tid in new_token_ids:
            before = len(self.output_text)
            chunk = self._step(tid)
            self.num_tokens += 1
            if chunk:
                self.output_text += chunk
            if self.stop and len(self.output_text) > before and self.num_tokens > self.min_tokens:
                found = self._find_stop(before)
                if found is not None:
                    return found
        return None

    def _find_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s) if self.include_stop else i]
        return s

    def get_delta(self, finished: bool) -> str:
        end = len(self.output_text) if finished else max(self._sent, len(self.output_text) - self.hold_back)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta
