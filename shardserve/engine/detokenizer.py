"""Incremental detokenization and stop strings, per request.

Decoding token by token breaks multi-byte characters and, for SentencePiece vocabularies, the
leading-space rule; so we decode a short sliding window and emit only the text that is new and
complete (no trailing U+FFFD)::

    tokens:  ... [prefix_offset ........ read_offset) [new]
    new text = decode(prefix..new) minus decode(prefix..read)

While a stop string may still be forming, the last `max_stop_len - 1` characters are held back
from the stream, so it never shows a prefix of a stop string that is later cut. A stop string
ending in the newest characters starts at most `max_stop_len - 1` characters before them, so it
lies within the text not yet handed out (`pending`): only that tail is ever searched or cut, and
each token costs the same whatever the request's length.
"""
from __future__ import annotations

from shardserve.request import SamplingParams

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.tokens = list(context)  # only the window [prefix_offset:] is ever decoded
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.emitted: list[str] = []  # text handed out so far, in pieces
        self.num_emitted_chars = 0
        self.pending = ""  # text not handed out yet (cut at a stop string)
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    @property
    def text(self) -> str:
        """All output text so far (cut at a stop string). Joins the pieces: call once, at the end."""
        return "".join(self.emitted) + self.pending

    def push(self, token_id: int) -> str | None:
        """Add one generated token. Returns the stop string when this token completed one.
        Without a tokenizer (skip_tokenizer_init) there is no text."""
        if self.tokenizer is None:
            return None
        self.tokens.append(token_id)
        skip = self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full_text = self.tokenizer.decode(self.tokens[self.prefix_offset :], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = full_text[len(prefix_text) :]
        del self.tokens[: self.read_offset]  # the next window starts at the current read offset
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        self.pending += delta
        return self._check_stop(len(delta))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self.params.stop:
            return None
        search_from = max(0, len(self.pending) - num_new_chars - self.holdback)
        for stop in self.params.stop:
            index = self.pending.find(stop, search_from)
            if index >= 0:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self.pending = self.pending[:end]
                return stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, minus the held-back tail."""
        end = len(self.pending) if finished else max(0, len(self.pending) - self.holdback)
        return self.skip(end)

    def skip(self, num_chars: int) -> str:
        """Hand out the next `num_chars` pending characters (at most all of them); returns them.
        A resumed request skips what the client already has."""
        new, self.pending = self.pending[:num_chars], self.pending[num_chars:]
        if new:
            self.emitted.append(new)
            self.num_emitted_chars += len(new)
        return new
