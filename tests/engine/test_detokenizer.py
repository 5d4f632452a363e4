from shardserve.engine.detokenizer import IncrementalDetokenizer
from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.tokenizer import load_tokenizer
from shardserve.request import SamplingParams

TOKENIZER = load_tokenizer(load_checkpoint("smollm2"))


def stream(text: str, **params):
    ids = TOKENIZER.encode(text)
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("Prompt:"), SamplingParams(**params))
    pieces, stop = [], None
    for t in ids:
        stop = detok.push(t)
        pieces.append(detok.take_new_text(stop is not None))
        if stop:
            break
    pieces.append(detok.take_new_text(True))
    return "".join(pieces), detok.text, stop


def test_incremental_text_equals_full_decode_with_multibyte_characters():
    text = " naïve café — 東京 👋🏽 done"
    streamed, full, _ = stream(text)
    assert streamed == full == TOKENIZER.decode(TOKENIZER.encode(text))


def test_stop_string_cuts_text_and_is_never_streamed():
    streamed, full, stop = stream(" one two THE END three", stop=["THE END"])
    assert stop == "THE END" and full == streamed == " one two "


def test_include_stop_string():
    _, full, _ = stream(" alpha beta gamma", stop=["beta"], include_stop_str_in_output=True)
    assert full == " alpha beta"
