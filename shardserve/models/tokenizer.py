"""Text <-> token ids and chat templates, on the Rust `tokenizers` library (never transformers,
whose import alone takes seconds).

Two sources:
    HF folder: tokenizer.json (+ tokenizer_config.json for chat template, BOS/EOS, add_bos_token)
    GGUF:      byte-level BPE rebuilt from `tokenizer.ggml.*` metadata (tokens, merges, token types)
               with the pre-tokenizer llama.cpp picks for `tokenizer.ggml.pre`.
BOS is added by `encode` itself (never by a post-processor), only when the model's config says so.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from shardserve.config import ConfigError
from shardserve.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from shardserve.models.checkpoint import Checkpoint

# End-of-turn markers of common chat formats; generation also stops on these when in the vocab.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")
# llama.cpp token types (tokenizer.ggml.token_type).
CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4

# Pre-tokenizer split patterns, as llama.cpp uses them per `tokenizer.ggml.pre`.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre_tokenizer() -> Any:
    # ByteLevel with use_regex applies GPT-2's own split pattern before mapping bytes to symbols.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre_tokenizer() -> Any:
    # llama.cpp's "smollm"/"starcoder" rule: every digit is its own piece (\p{N}), then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()])


def _split_pre_tokenizer(pattern: str) -> Any:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> (pre-tokenizer factory, ignore_merges). llama.cpp looks a whole pre-token up in
# the vocab before merging for the Llama 3 family; the HF tokenizer.json says the same (ignore_merges).
GGUF_PRE_TOKENIZERS = {
    "default": (_gpt2_pre_tokenizer, False),
    "gpt-2": (_gpt2_pre_tokenizer, False),
    "smollm": (_digits_then_gpt2_pre_tokenizer, False),
    "starcoder": (_digits_then_gpt2_pre_tokenizer, False),
    "refact": (_digits_then_gpt2_pre_tokenizer, False),
    "llama-bpe": (lambda: _split_pre_tokenizer(_LLAMA3_PATTERN), True),
    "llama3": (lambda: _split_pre_tokenizer(_LLAMA3_PATTERN), True),
    "smaug-bpe": (lambda: _split_pre_tokenizer(_LLAMA3_PATTERN), True),
    "qwen2": (lambda: _split_pre_tokenizer(_QWEN2_PATTERN), False),
    "deepseek-r1-qwen": (lambda: _split_pre_tokenizer(_QWEN2_PATTERN), False),
}


@dataclass(frozen=True)
class Tokenizer:
    """A fast tokenizer plus the chat template and special tokens of one model."""

    backend: BackendTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    _template: jinja2.Template | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            object.__setattr__(self, "_template", _compile_template(self.chat_template))

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """From `tokenizer.json` and (optional) `tokenizer_config.json` / `chat_template.jinja`.
        Without an explicit add_bos_token, BOS is added iff tokenizer.json's post-processor adds it."""
        folder = Path(path)
        try:
            backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
            config_path = folder / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ConfigError(f"{folder}: cannot read tokenizer ({e})") from None
        template_path = folder / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else _pick_template(
            config.get("chat_template"))
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            bos_id = backend.token_to_id(bos) if bos else None
            add_bos = bos_id is not None and bos_id in backend.encode("a", add_special_tokens=True).ids
        backend.no_truncation()
        backend.no_padding()
        return cls(backend, template, bos, eos, bool(add_bos))

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFFile | Any) -> "Tokenizer":
        """From a GGUF's `tokenizer.*` metadata. `source` is a path, a GGUFFile, or a
        gguf.GGUFReader. Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported."""
        path, metadata = _gguf_metadata(source)
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ConfigError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE "
                              "'gpt2'); use the model's HF folder with tokenizer.json instead")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ConfigError(f"{path}: unknown GGUF pre-tokenizer {pre!r}; supported: "
                              f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))}")
        make_pre_tokenizer, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
        # Byte-level symbols never contain a real space, so each merge is exactly "left right".
        merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", ())]
        vocab = {token: token_id for token_id, token in enumerate(tokens)}
        backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = make_pre_tokenizer()
        backend.decoder = decoders.ByteLevel()
        _add_gguf_special_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type") or ())

        def token_at(key: str) -> str | None:
            token_id = metadata.get(key)
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        return cls(
            backend,
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        )

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. "<|im_start|>") map to
        their ids. BOS is prepended when add_special_tokens and the model adds BOS."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos_id = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos_id is not None:
            ids = [bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.
        Extra keyword arguments (e.g. tools) are passed to the template. ConfigError if the model
        has no template or the template fails."""
        if self._template is None:
            raise ConfigError("this model has no chat template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:
            raise ConfigError(f"chat template failed: {e}") from None

    # -- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS id first, then any end-of-turn marker (END_OF_TURN_TOKENS) in the vocab."""
        candidates = ([self.eos_token] if self.eos_token else []) + list(END_OF_TURN_TOKENS)
        ids = (self.backend.token_to_id(token) for token in candidates)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]


def load_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    """The tokenizer that belongs to `checkpoint` (its folder's tokenizer.json, or its GGUF metadata)."""
    if checkpoint.format == "gguf":
        return Tokenizer.from_gguf(checkpoint.open_files())
    return Tokenizer.from_hf_folder(checkpoint.path)


def _gguf_metadata(source: Any) -> tuple[Path, dict[str, Any]]:
    if isinstance(source, GGUFFile):
        return source.path, source.metadata
    if hasattr(source, "fields"):  # gguf.GGUFReader; its field values decode via contents()
        return Path(getattr(source.data, "filename", "<gguf>")), {
            key: value.contents() for key, value in source.fields.items()}
    gguf_file = GGUFFile.open(source)
    return gguf_file.path, gguf_file.metadata


def _add_gguf_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special (matched whole in text, skipped by decode); user-defined ones
    are matched whole but decoded like text, which is what llama.cpp does with both."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN_TYPE]
    added = [AddedToken(t, special=False, normalized=False)
             for t, kind in zip(tokens, token_types) if kind == USER_DEFINED_TOKEN_TYPE]
    if special:
        backend.add_special_tokens(special)
    if added:
        backend.add_tokens(added)


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ..., ...}.
    return token.get("content") if isinstance(token, dict) else token


def _pick_template(template: Any) -> str | None:
    # Some configs hold several named templates; the chat one is called "default".
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **kwargs: Any) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, **kwargs)

    # Chat templates are written for these settings (the ones HF templates are tested against).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"chat template does not compile: {e}") from None
