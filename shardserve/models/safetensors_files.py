"""A Hugging Face checkpoint folder: config.json plus one or more .safetensors files.

    folder/config.json
    folder/model.safetensors                       one file, or
    folder/model.safetensors.index.json            {"weight_map": {tensor name: shard file}}
    folder/model-00001-of-00002.safetensors ...

Tensors are read lazily through `safetensors.safe_open` (an mmap), one at a time, so loading never
holds more than the tensor being copied; `get_slice` reads only part of a tensor, which is what a
tensor-parallel rank needs.
"""
from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from shardserve.config import ConfigError, ModelConfig
from shardserve.layers.lazy_tensor import LazyTensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Buffers some old checkpoints saved alongside the weights; the model recomputes them.
_NON_WEIGHT_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(folder: Path, shapes_only: bool = False) -> ModelConfig:
    """ModelConfig from `folder/config.json`; ConfigError if it is missing, not JSON or unsupported
    (`shapes_only`: see ModelConfig.from_hf_config)."""
    config_path = Path(folder) / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder}: folder has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path}: cannot read config ({e})") from None
    try:
        return ModelConfig.from_hf_config(hf, shapes_only)
    except KeyError as e:
        raise ConfigError(f"{config_path}: missing field {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from None


@dataclass(frozen=True)
class SafetensorsFiles:
    """The weights of one HF folder: which file holds each tensor, checked to exist and parse."""

    folder: Path
    weight_map: dict[str, Path]  # tensor name -> file, grouped by file in file order

    @classmethod
    def open(cls, folder: str | Path) -> "SafetensorsFiles":
        """Find and validate the safetensors files of `folder` (headers only; no tensor is read).
        Raises ConfigError naming the file for: no safetensors files, a shard named in the index that
        is missing, an unreadable index, a corrupt or truncated file, an index entry absent from its shard."""
        folder = Path(folder)
        files, index = _list_files(folder)
        weight_map: dict[str, Path] = {}
        for file in files:
            for name in _tensor_names(file):
                if not name.endswith(_NON_WEIGHT_SUFFIXES):
                    weight_map[name] = file
        for name, file in (index or {}).items():
            if weight_map.get(name) != file:
                raise ConfigError(f"{folder / INDEX_FILE}: tensor {name!r} is not in {file.name}")
        return cls(folder, weight_map)

    @property
    def num_bytes(self) -> int:
        return sum(file.stat().st_size for file in set(self.weight_map.values()))

    def get_tensor(self, name: str) -> torch.Tensor:
        """One whole tensor, in the file's dtype."""
        with _open(self._file_of(name)) as f:
            return _checked(self._file_of(name), name, f.get_tensor(name))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`tensor[..., start:stop, ...]` along `dim`, reading only those bytes from disk."""
        file = self._file_of(name)
        with _open(file) as f:
            lazy = f.get_slice(name)
            index = [slice(None)] * len(lazy.get_shape())
            index[dim] = slice(start, stop)
            return _checked(file, name, lazy[tuple(index)])

    def iter_tensors(self, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for every weight, each file opened once, tensors read one at a time."""
        for name, lazy in self.iter_lazy_tensors(show_progress):
            yield name, lazy.read()

    def iter_lazy_tensors(self, show_progress: bool = False) -> Iterator[tuple[str, LazyTensor]]:
        """Yield (name, LazyTensor) for every weight; each is readable, whole or in slices, until
        the next one is yielded (its file stays open only that long)."""
        by_file: dict[Path, list[str]] = {}
        for name, file in self.weight_map.items():
            by_file.setdefault(file, []).append(name)
        with tqdm(total=self.num_bytes, unit="B", unit_scale=True, desc=f"loading {self.folder.name}",
                  file=sys.stderr, disable=not show_progress) as bar:
            for file, names in by_file.items():
                with _open(file) as f:
                    for name in names:
                        handle = f.get_slice(name)
                        if handle.get_dtype() not in _FLOAT_DTYPES:
                            raise ConfigError(
                                f"{file}: tensor {name!r} has dtype {handle.get_dtype()}; only float "
                                "checkpoints are supported (quantized HF checkpoints are not)")
                        shape = tuple(handle.get_shape())
                        yield name, LazyTensor(shape, _slice_reader(handle, len(shape)))
                        bar.update(math.prod(shape) * _FLOAT_DTYPES[handle.get_dtype()])

    def _file_of(self, name: str) -> Path:
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.folder}: no tensor {name!r}")
        return file


def _list_files(folder: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """(safetensors files, index weight map or None)."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            raw_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
        index = {name: folder / shard for name, shard in raw_map.items()}
        files = list(dict.fromkeys(index.values()))
        for file in files:
            if not file.is_file():
                raise ConfigError(f"{index_path}: names shard {file.name}, which is missing")
        return files, index
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE], None
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files, None
    hint = " (PyTorch .bin checkpoints are not supported; convert to safetensors)" if any(
        folder.glob("*.bin")) else ""
    raise ConfigError(f"{folder}: no safetensors files{hint}")


def _tensor_names(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


@contextmanager
def _open(file: Path) -> Iterator:
    """`safe_open` that turns a corrupt or unreadable file into ConfigError naming the file."""
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    with handle as f:
        yield f


_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype -> bytes per element


def _slice_reader(handle, ndim: int):
    def read(dim, start, stop):
        index = [slice(None)] * ndim
        if dim is not None:
            index[dim] = slice(start, stop)
        return handle[tuple(index)]
    return read


def _checked(file: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise ConfigError(f"{file}: tensor {name!r} has dtype {tensor.dtype}; only float checkpoints "
                          "are supported (quantized HF checkpoints are not)")
    return tensor
