"""A GGUF checkpoint (llama.cpp's single-file format): metadata -> ModelConfig, tensors -> HF names.

Layout of a GGUF v2/v3 file (little-endian):

    magic "GGUF" | version u32 | num_tensors u64 | num_kv u64
    num_kv x (key: str, value_type u32, value)          <- metadata (vocab, merges, shapes, ...)
    num_tensors x (name: str, n_dims u32, ne u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset      (str = u64 length + utf-8 bytes)

We parse the header ourselves instead of using `gguf.GGUFReader`: the reader builds a numpy view per
string, which takes ~1.7 s for SmolLM2's 49k-token vocabulary, and the tokenizer has to build in well
under that. The `gguf` package still does the hard part, dequantizing the block formats.
"""
from __future__ import annotations

import functools
import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType
from tqdm import tqdm

from shardserve.config import ConfigError, ModelConfig, RopeScaling
from shardserve.layers.block_quant import FORMATS, RawBlocks
from shardserve.layers.lazy_tensor import LazyTensor

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT_BYTES = 32

# GGUF `general.architecture` -> our family. llama.cpp's converter writes Mistral as "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# Stored as-is (in the file's float dtype); everything else in QUANTIZED_TYPES dequantizes to float32.
FLOAT_TYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
QUANTIZED_TYPES = frozenset({
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS,
})

_SCALAR_FORMATS = {
    VType.UINT8: "<B", VType.INT8: "<b", VType.UINT16: "<H", VType.INT16: "<h",
    VType.UINT32: "<I", VType.INT32: "<i", VType.FLOAT32: "<f", VType.BOOL: "<?",
    VType.UINT64: "<Q", VType.INT64: "<q", VType.FLOAT64: "<d",
}

# GGUF name inside block N -> HF name inside "model.layers.N."
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives. `shape` is in torch order (GGUF stores `ne`, innermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset_bytes: int  # absolute position in the file
    num_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header; tensor data is read lazily from `path`, one tensor at a time."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # GGUF name -> info, in file order

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Parse the header of `path`. Raises ConfigError("<file>: truncated or corrupt GGUF (...)")
        when the header or any tensor's data runs past the end of the file or is malformed."""
        path = Path(path)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return cls(path, *_parse_header(buf, path))
        except ConfigError:
            raise
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, IndexError, KeyError) as e:
            raise ConfigError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def model_config(self) -> ModelConfig:
        """ModelConfig from the `<arch>.*` and `tokenizer.ggml.*` metadata."""
        return _model_config(self)

    def read_tensor(self, gguf_name: str) -> torch.Tensor:
        """One tensor by its GGUF name, in torch shape, exactly as stored: F32/F16/BF16 keep their
        dtype, quantized types are dequantized to float32. No llama.cpp row permutation is undone here."""
        info = self.tensors.get(gguf_name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor {gguf_name!r}")
        return _read_tensor(self.path, info)

    def iter_tensors(self, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) for every weight, in HF Llama/Qwen2 layout (Q/K rows un-permuted
        for llama-arch files), dequantizing one tensor at a time so peak memory stays ~one tensor."""
        for hf_name, lazy in self.iter_lazy_tensors(show_progress):
            yield hf_name, lazy.read()

    def iter_lazy_tensors(self, show_progress: bool = False) -> Iterator[tuple[str, LazyTensor]]:
        """Like iter_tensors, each tensor read only when asked for (and then whole: dequantized,
        then sliced); a tensor in a block format the kernels keep (layers/block_quant.py) can
        instead be read as its blocks, row order un-permuted the same way."""
        config = self.model_config()
        names = {name: _hf_name(name, self.path) for name in self.tensors}
        total_bytes = sum(self.tensors[n].num_bytes for n, hf in names.items() if hf is not None)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"loading {self.path.name}",
                  file=sys.stderr, disable=not show_progress) as bar:
            for gguf_name, hf_name in names.items():
                if hf_name is None:
                    continue
                info = self.tensors[gguf_name]
                yield hf_name, self._lazy(info, hf_name, config)
                bar.update(info.num_bytes)

    def _lazy(self, info: GGUFTensorInfo, hf_name: str, config: ModelConfig) -> LazyTensor:
        permute = self.architecture == "llama"

        @functools.cache
        def whole() -> torch.Tensor:
            tensor = _read_tensor(self.path, info)
            return _undo_rotary_permutation(hf_name, tensor, config) if permute else tensor

        def read(dim, start, stop):
            return whole() if dim is None else whole().narrow(dim, start, stop - start)

        blocks = None
        if QType(info.ggml_type) in FORMATS and len(info.shape) == 2:
            def blocks() -> RawBlocks:
                raw = RawBlocks(QType(info.ggml_type), _read_raw(self.path, info).reshape(info.shape[0], -1),
                                info.shape[1])
                if not permute:
                    return raw
                order = _undo_rotary_permutation(hf_name, torch.arange(info.shape[0]), config)
                return raw if torch.equal(order, torch.arange(info.shape[0])) else raw.permute_rows(order)
        return LazyTensor(info.shape, read, blocks)


def _parse_header(buf: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    if buf[:4] != GGUF_MAGIC:
        raise ConfigError(f"{path}: truncated or corrupt GGUF (bad magic {bytes(buf[:4])!r})")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ConfigError(f"{path}: unsupported GGUF version {version} (big-endian or too new?)")
    reader = _HeaderReader(buf, 24)
    metadata = {}
    for _ in range(num_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    raw_infos = []
    for _ in range(num_tensors):
        name = reader.string()
        ne = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
        raw_infos.append((name, ne, reader.scalar("<I"), reader.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT_BYTES))
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, ne, type_id, offset in raw_infos:
        info = _tensor_info(name, ne, type_id, data_start + offset, path)
        if info.offset_bytes + info.num_bytes > len(buf):
            raise ConfigError(
                f"{path}: truncated or corrupt GGUF (tensor {name} ends at byte "
                f"{info.offset_bytes + info.num_bytes}, the file has {len(buf)} bytes)"
            )
        tensors[name] = info
    return metadata, tensors


def _tensor_info(name: str, ne: list[int], type_id: int, offset: int, path: Path) -> GGUFTensorInfo:
    try:
        qtype = QType(type_id)
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ConfigError(f"{path}: tensor {name} has unknown ggml type id {type_id}") from None
    num_elements = int(np.prod(ne, dtype=np.int64)) if ne else 1
    if ne and ne[0] % block_size:
        raise ConfigError(f"{path}: truncated or corrupt GGUF (tensor {name} row of {ne[0]} is not "
                          f"a multiple of {qtype.name} blocks of {block_size})")
    return GGUFTensorInfo(name, tuple(reversed(ne)), int(qtype), offset, num_elements // block_size * block_bytes)


class _HeaderReader:
    """Cursor over the header bytes; every read raises struct.error/ValueError past the end."""

    def __init__(self, buf: mmap.mmap, pos: int):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        num_bytes = self.scalar("<Q")
        end = self.pos + num_bytes
        if end > len(self.buf):
            raise ValueError(f"string of {num_bytes} bytes at byte {self.pos} runs past the end")
        text = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def value(self, type_id: int) -> Any:
        vtype = VType(type_id)
        if vtype == VType.STRING:
            return self.string()
        if vtype == VType.ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMATS[vtype])

    def array(self) -> list[Any]:
        vtype = VType(self.scalar("<I"))
        count = self.scalar("<Q")
        if vtype in _SCALAR_FORMATS:
            # Numeric arrays (token types, scores) in one numpy read instead of one unpack per item.
            dtype = np.dtype(_SCALAR_FORMATS[vtype])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        return [self.value(vtype) for _ in range(count)]


def _read_raw(path: Path, info: GGUFTensorInfo) -> torch.Tensor:
    """The tensor's bytes as stored, uint8."""
    raw = np.fromfile(path, dtype=np.uint8, count=info.num_bytes, offset=info.offset_bytes)
    if raw.size != info.num_bytes:  # the file shrank since the header was parsed
        raise ConfigError(f"{path}: truncated or corrupt GGUF (tensor {info.name} is cut short)")
    return torch.from_numpy(raw)


def _read_tensor(path: Path, info: GGUFTensorInfo) -> torch.Tensor:
    qtype = QType(info.ggml_type)
    if qtype not in FLOAT_TYPES and qtype not in QUANTIZED_TYPES:
        raise ConfigError(f"{path}: tensor {info.name} has unsupported type {qtype.name}; "
                          f"supported: {', '.join(sorted(t.name for t in (*FLOAT_TYPES, *QUANTIZED_TYPES)))}")
    raw = _read_raw(path, info).numpy()
    if qtype == QType.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(info.shape))
    if qtype == QType.F16:
        return torch.from_numpy(raw.view(np.float16).reshape(info.shape))
    if qtype == QType.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(info.shape)).view(torch.bfloat16)
    rows = raw.reshape(*info.shape[:-1], -1)  # one row of blocks per output row
    return torch.from_numpy(gguf.quants.dequantize(rows, qtype).astype(np.float32, copy=False))


def _hf_name(gguf_name: str, path: Path) -> str | None:
    """HF name for a GGUF tensor; None for tensors with no HF counterpart (folded into the config)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ConfigError(f"{path}: unexpected tensor {gguf_name!r} (not a Llama/Qwen2 weight)")


def _undo_rotary_permutation(hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp's converter reorders the rows of each q/k head from HF's rotary layout (first half,
    second half) to interleaved pairs, because ggml rotates adjacent elements:

        HF row of head h:    (h, half j, index i)   j in {0, 1}, i in [0, head_dim/2)
        GGUF row of head h:  (h, index i, half j)

    Viewing GGUF rows as [heads, head_dim/2, 2] and swapping the last two axes restores HF order.
    """
    if hf_name.endswith("self_attn.q_proj.weight") or hf_name.endswith("self_attn.q_proj.bias"):
        num_heads = config.num_heads
    elif hf_name.endswith("self_attn.k_proj.weight") or hf_name.endswith("self_attn.k_proj.bias"):
        num_heads = config.num_kv_heads
    else:
        return tensor
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, -1, 2, *rest).transpose(1, 2).reshape(tensor.shape).contiguous()


def _model_config(file: GGUFFile) -> ModelConfig:
    md, arch, path = file.metadata, file.architecture, file.path
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                          f"{', '.join(sorted(GGUF_ARCHITECTURES))}")

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"{path}: GGUF metadata has no {arch}.{key}")
        if isinstance(value, list):
            raise ConfigError(f"{path}: per-layer {arch}.{key} is not supported")
        return value

    hidden_size, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError(f"{path}: partial rotary ({arch}.rope.dimension_count != head_dim) is not supported")
    embed = file.tensors.get("token_embd.weight")
    vocab_size = embed.shape[0] if embed else len(md.get("tokenizer.ggml.tokens", ())) or int(get("vocab_size"))
    eos = md.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        # GGUF stores these as float32; 7 significant digits gives back the config's 1e-05, not 9.99e-06.
        rms_norm_eps=_float32_to_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_float32_to_decimal(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(file, arch),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in file.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _float32_to_decimal(value: float) -> float:
    return float(f"{float(value):.7g}")


def _rope_scaling(file: GGUFFile, arch: str) -> RopeScaling:
    if "rope_freqs.weight" in file.tensors:
        return _llama3_rope_scaling(file, arch)
    kind = file.metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(file.metadata.get(f"{arch}.rope.scaling.factor", 1.0)))
    raise ConfigError(f"{file.path}: unsupported rope scaling {kind!r}; supported: none, linear")


def _llama3_rope_scaling(file: GGUFFile, arch: str) -> RopeScaling:
    """Llama 3.1+ files carry the llama3 scaling as precomputed per-frequency divisors (`rope_freqs`)
    instead of its parameters. Every Llama 3.x release uses low/high freq factors 1 and 4 over an
    original 8192 context and differs only in `factor` (the largest divisor), so we take that, then
    check the whole tensor against the divisors those parameters give."""
    divisors = file.read_tensor("rope_freqs.weight").double()
    candidate = RopeScaling(kind="llama3", factor=_float32_to_decimal(divisors.max()), low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=8192)
    theta = float(file.metadata.get(f"{arch}.rope.freq_base", 10000.0))
    expected = llama3_rope_divisors(theta, 2 * divisors.numel(), candidate)
    if not torch.allclose(divisors, expected, rtol=1e-4):
        raise ConfigError(f"{file.path}: rope_freqs tensor does not match llama3 rope scaling with "
                          f"factor {candidate.factor:g}, low/high freq factors 1/4, original context 8192")
    return candidate


def llama3_rope_divisors(theta: float, rotary_dim: int, scaling: RopeScaling) -> torch.Tensor:
    """What each rotary frequency is divided by under llama3 scaling: 1 for wavelengths shorter than
    original_context / high_freq_factor, `factor` for ones longer than original_context / low_freq_factor,
    and a smooth blend in between. Shape [rotary_dim / 2], float64."""
    freqs = theta ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    wavelengths = 2 * torch.pi / freqs
    context = scaling.original_max_position_embeddings
    smooth = (context / wavelengths - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = 1 / ((1 - smooth) / scaling.factor + smooth)
    divisors = torch.where(wavelengths > context / scaling.low_freq_factor, scaling.factor, blended)
    return torch.where(wavelengths < context / scaling.high_freq_factor, 1.0, divisors)
