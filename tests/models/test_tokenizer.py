"""Tokenizer built from GGUF metadata and from an HF folder, against transformers' own GGUF tokenizer."""
from __future__ import annotations

import dataclasses
import time

import gguf
import pytest

from shardserve.config import ConfigError
from shardserve.models.checkpoint import load_checkpoint, resolve_model_path
from shardserve.models.gguf_file import GGUFFile
from shardserve.models.tokenizer import Tokenizer, load_tokenizer

SMOLLM2 = resolve_model_path("smollm2")

TEXTS = [
    "Hello, world!",
    "In 2024, 12345 apples cost $3.99 (or 1,000,000 yen).",
    "a1b2c3 3.14159 1e-9 0x1F 007",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nand   runs     of   spaces",
    "héllo wörld — “quotes” and ‘more’ … ñ ß ø",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 🤖🎉👩‍💻 and symbols ∑∫√≠ ≤ ≥",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "I'm sure you're right; they've said we'll see, she'd agree, it's OK",
    "I'M SURE YOU'RE RIGHT",
    "URL: https://example.com/path?q=1&r=two#frag",
    "<repo_name>not really a repo<file_sep>",
    "",
    " ",
    "\n",
    "Ünïcödé at the start and the end ß",
    "mixed\r\nline\rendings\n",
    "''''\"\"\"```",
]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    print(f"transformers GGUF tokenizer: {time.perf_counter() - start:.1f} s")
    return tokenizer


@pytest.fixture(scope="module")
def ours():
    start = time.perf_counter()
    tokenizer = Tokenizer.from_gguf(SMOLLM2)
    elapsed_s = time.perf_counter() - start
    print(f"our GGUF tokenizer build (header parse included): {elapsed_s:.2f} s")
    assert elapsed_s < 2.0
    return tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference(text)["input_ids"]
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_digits_are_split_before_the_gpt2_pattern(ours):
    """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) splits off every digit
    first, then applies GPT-2's pattern. transformers' GGUF path skips the digit split; the two agree
    except on whitespace runs right before a digit, where GPT-2's pattern alone glues one space to
    the digit (and the vocabulary has no "space+digit" token, so the run comes out one piece longer)."""
    assert ours.convert_ids_to_tokens(ours.encode("x 2024")) == ["x", "Ġ", "2", "0", "2", "4"]
    assert ours.convert_ids_to_tokens(ours.encode("x  2")) == ["x", "ĠĠ", "2"]
    assert ours.convert_ids_to_tokens(ours.encode("\n\n3")) == ["ĊĊ", "3"]


CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.mark.parametrize("messages", [CHAT, [{"role": "system", "content": "Be brief."}] + CHAT[:2]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_special_tokens(ours):
    assert ours.bos_token_id == 1 and ours.id_to_token(1) == "<|im_start|>"
    assert ours.eos_token_ids == (2, 0)  # <|im_end|> (the GGUF's eos), then <|endoftext|>
    assert ours.vocab_size == 49152
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)  # SmolLM2 adds no BOS


def test_bos_added_only_when_the_model_says_so():
    file = GGUFFile.open(SMOLLM2)
    with_bos = dataclasses.replace(file, metadata={**file.metadata, "tokenizer.ggml.add_bos_token": True})
    tokenizer = Tokenizer.from_gguf(with_bos)
    assert tokenizer.encode("hi") == [1, *tokenizer.encode("hi", add_special_tokens=False)]


def test_from_gguf_reader_and_checkpoint_agree(ours):
    from_reader = Tokenizer.from_gguf(gguf.GGUFReader(str(SMOLLM2)))
    from_checkpoint = load_tokenizer(load_checkpoint("smollm2"))
    for tokenizer in (from_reader, from_checkpoint):
        assert tokenizer.encode(TEXTS[10]) == ours.encode(TEXTS[10])
        assert tokenizer.apply_chat_template(CHAT) == ours.apply_chat_template(CHAT)


def test_hf_folder_matches_transformers(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference(text)["input_ids"], text
    assert tokenizer.apply_chat_template(CHAT) == reference.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    assert tokenizer.eos_token_ids[0] == reference.eos_token_id


def test_raise_exception_in_template_is_config_error():
    tokenizer = Tokenizer.from_gguf(SMOLLM2)
    strict = dataclasses.replace(tokenizer, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ConfigError, match="roles must alternate"):
        strict.apply_chat_template(CHAT)


def test_sentencepiece_gguf_is_a_clear_error():
    file = GGUFFile.open(SMOLLM2)
    llama_vocab = dataclasses.replace(file, metadata={**file.metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ConfigError, match=r"SmolLM2.*GGUF tokenizer model 'llama' is not supported"):
        Tokenizer.from_gguf(llama_vocab)


def test_unknown_pre_tokenizer_is_a_clear_error():
    file = GGUFFile.open(SMOLLM2)
    unknown = dataclasses.replace(file, metadata={**file.metadata, "tokenizer.ggml.pre": "made-up"})
    with pytest.raises(ConfigError, match="unknown GGUF pre-tokenizer 'made-up'"):
        Tokenizer.from_gguf(unknown)
