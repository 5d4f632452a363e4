"""The one check of what a request asks for, before it reaches the scheduler: the HTTP layer calls
it in its handlers (so bad input is a 400 there) and `LLMEngine.add_request` calls it for every
other caller. Each rule is written here once."""
from __future__ import annotations

from shardserve.engine.scheduler import max_num_tokens
from shardserve.request import InvalidRequestError, SamplingParams


class InputValidator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, grammars=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars  # engine/grammar.py's Grammars: structured outputs

    def require_tokenizer(self, param: str, what: str) -> None:
        """InvalidRequestError when the engine runs without a tokenizer (skip_tokenizer_init)."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs the model's tokenizer, and this engine runs without one "
                                      "(skip_tokenizer_init): send token ids", param)

    def sampling(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError for what `params` asks that this engine cannot do."""
        if params.stop:
            self.require_tokenizer("stop", "stop strings")
        self.structured_outputs(params)

    def structured_outputs(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError (naming the field) unless the request's structured output,
        if any, compiles within the size and nesting limits."""
        spec = params.structured_outputs
        if spec is not None:
            self.require_tokenizer(spec.param, "structured outputs")
            self.grammars.compile(spec)

    def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids (text is encoded). Raises InvalidRequestError unless the prompt
        is non-empty, fits the context window and the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            self.require_tokenizer("prompt", "a text prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but the context window is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)", "prompt")
        self.check_vocab(token_ids, "token ids", "prompt")
        return token_ids

    def token_budget(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """The tokens the prompt leaves in the window; raises when `max_tokens` asks for more."""
        budget = self.max_model_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > budget:
            raise InvalidRequestError(f"this model's context window is {self.max_model_len} tokens; the prompt "
                                      f"has {len(prompt_ids)}, so max_tokens can be at most {budget}", "max_tokens")
        return budget

    def resume(self, prompt_ids: list[int], params: SamplingParams, ids) -> None:
        """Raise InvalidRequestError unless `ids` can be a request's output so far."""
        if not ids:
            raise InvalidRequestError("resume_token_ids is empty", "resume_token_ids")
        self.check_vocab(ids, "resume token ids", "resume_token_ids")
        if len(prompt_ids) + len(ids) >= max_num_tokens(len(prompt_ids), params.max_tokens, self.max_model_len):
            raise InvalidRequestError("the resumed request has no token budget left", "resume_token_ids")
        if params.structured_outputs is not None:  # the grammar is replayed over them
            self.structured_outputs(params)
            self.grammars.check_tokens(params.structured_outputs, list(ids))

    def check_vocab(self, ids, what: str, param: str) -> None:
        """Raises InvalidRequestError unless every id is a token of the vocabulary."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequestError(f"{what} must be in [0, {self.vocab_size})", param)
