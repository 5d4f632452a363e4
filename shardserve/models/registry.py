"""Model family name -> implementation class."""
from __future__ import annotations

from shardserve.models.decoder import DecoderModel

MODEL_CLASSES = {
    "llama": DecoderModel,
    "mistral": DecoderModel,
    "qwen2": DecoderModel,
    "qwen3": DecoderModel,
    "mixtral": DecoderModel,
    "qwen2_moe": DecoderModel,
    "qwen3_moe": DecoderModel,
}


def model_class(architecture: str):
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"no implementation for architecture {architecture!r}; have: {', '.join(MODEL_CLASSES)}") from None
