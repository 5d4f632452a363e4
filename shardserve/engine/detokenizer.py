"""Incremental detokenization and stop strings, per request.

Decoding token by token breaks multi-byte characters and, for SentencePiece vocabularies, the
leading-space rule; so we decode a short sliding window and emit only the text that is new and
complete (no trailing U+FFFD)::

    tokens:  ... [prefix_offset ........ read_offset) [new]
    emitted text = decode(prefix..new) minus decode(prefix..read)

While a stop string may still be forming, the last `max_stop_len - 1` characters are held back
from `new_text`, so a stream never shows a prefix of a stop string that is later cut.
"""
from __future__ import annotations

from shardserve.request import SamplingParams

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.tokens = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # all output text so far (cut at a stop string)
        self.num_emitted_chars = 0
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def push(self, token_id: int) -> str | None:
        """Add one generated token. Returns the stop string when this token completed one."""
        self.tokens.append(token_id)
        skip = self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full_text = self.tokenizer.decode(self.tokens[self.prefix_offset :], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return self._check_stop(len(delta))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self.params.stop:
            return None
        search_from = max(0, len(self.text) - num_new_chars - self.holdback)
        for stop in self.params.stop:
            index = self.text.find(stop, search_from)
            if index >= 0:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self.text = self.text[:end]
                return stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, minus the held-back tail."""
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.holdback)
        new = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return new
