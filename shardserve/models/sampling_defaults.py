"""A model's own sampling defaults, for the fields a request leaves out (as vLLM does with
`--generation-config auto`): the sampling keys of an HF folder's generation_config.json, or for
an embedded GGUF (which carries none) the values its model card recommends."""
from __future__ import annotations

import json
from pathlib import Path

from shardserve.config import ConfigError
from shardserve.models.checkpoint import embedded_name
from shardserve.request import MODEL_DEFAULT_FIELDS, InvalidRequestError, SamplingParams
# HuggingFaceTB/SmolLM2-135M-Instruct's model card samples with temperature 0.2, top_p 0.9
EMBEDDED_DEFAULTS = {"smollm2": {"temperature": 0.2, "top_p": 0.9}}


def sampling_defaults(model: str | None, path: Path) -> dict[str, float]:
    """{field: value} for the SamplingParams fields the model sets; {} when it sets none."""
    name = embedded_name(model)
    if name is not None:
        return dict(EMBEDDED_DEFAULTS.get(name, {}))
    file = path / "generation_config.json"
    if not path.is_dir() or not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: cannot read it: {exc}") from None
    found = {key: data[key] for key in MODEL_DEFAULT_FIELDS
             if isinstance(data, dict) and isinstance(data.get(key), (int, float)) and not isinstance(data[key], bool)}
    try:  # refused here, not as every request's 400
        SamplingParams(**found)
    except InvalidRequestError as exc:
        raise ConfigError(f"{file}: {exc}") from None
    return found
