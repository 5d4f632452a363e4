"""GGUF loading: dequantization per type, llama.cpp's Q/K permutation, config, corrupt files.

References: transformers' own GGUF loader (SmolLM2), gguf.quants' quantizer and a K-quant decoder
written here from ggml's block layout, and tiny HF models written to GGUF the way llama.cpp does.
"""
from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from shardserve.config import ConfigError
from shardserve.models.checkpoint import load_checkpoint, resolve_model_path
from shardserve.models.gguf_file import GGUFFile

SMOLLM2 = resolve_model_path("smollm2")


def write_gguf(path, arch, metadata, tensors):
    """tensors: name -> (array, raw ggml type or None for F32/F16 arrays)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- SmolLM2 against transformers -------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_state_dict(smollm2_reference):
    return smollm2_reference.state_dict()


def test_smollm2_tensors_match_transformers(reference_state_dict):
    checked = [
        "model.embed_tokens.weight", "model.norm.weight",
        *(f"model.layers.{i}.{name}.weight" for i in (0, 29) for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")),
    ]
    start = time.perf_counter()
    ours, names = {}, []
    for name, tensor in load_checkpoint("smollm2").iter_tensors():
        names.append(name)
        if name in checked:
            ours[name] = tensor
    print(f"our GGUF iteration: {time.perf_counter() - start:.1f} s")
    assert len(names) == len(set(names)) == 272
    assert set(names) == set(reference_state_dict) - {"lm_head.weight"}  # tied: no output.weight
    for name in checked:
        assert ours[name].dtype == torch.float32
        torch.testing.assert_close(ours[name], reference_state_dict[name], rtol=0, atol=1e-6, msg=name)


def test_smollm2_q_rows_are_permuted_back():
    """The raw GGUF rows differ from what we yield, so the permutation is really applied."""
    file = GGUFFile.open(SMOLLM2)
    raw = file.read_tensor("blk.0.attn_q.weight")
    ours = dict(_first_layer(load_checkpoint("smollm2")))["model.layers.0.self_attn.q_proj.weight"]
    assert raw.shape == ours.shape == (576, 576)
    assert not torch.equal(raw, ours)
    assert torch.equal(torch.sort(raw, dim=0).values, torch.sort(ours, dim=0).values)


def _first_layer(checkpoint):
    for name, tensor in checkpoint.iter_tensors():
        if name.startswith("model.layers.1."):
            return
        yield name, tensor


def test_smollm2_config():
    config = load_checkpoint("smollm2").config
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "llama", 30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.max_position_embeddings == 8192
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


# --- dequantization per type ------------------------------------------------------------------

def _source(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("qtype, dtype", [(QType.F32, torch.float32), (QType.F16, torch.float16),
                                          (QType.BF16, torch.bfloat16)])
def test_float_types_keep_their_dtype(tmp_path, qtype, dtype):
    source = _source((6, 64))
    stored = gguf.quants.quantize(source, qtype)
    raw_type = qtype if qtype == QType.BF16 else None
    path = write_gguf(tmp_path / "f.gguf", "llama", {}, {"w": (stored, raw_type)})
    tensor = GGUFFile.open(path).read_tensor("w")
    assert tensor.dtype == dtype and tensor.shape == (6, 64)
    assert torch.equal(tensor, torch.from_numpy(source).to(dtype))


@pytest.mark.parametrize("qtype, levels", [(QType.Q8_0, 127), (QType.Q4_0, 7), (QType.Q4_1, 15)])
def test_block_quantized_types(tmp_path, qtype, levels):
    source = _source((8, 96), seed=int(qtype))
    quantized = gguf.quants.quantize(source, qtype)
    path = write_gguf(tmp_path / "q.gguf", "llama", {}, {"w": (quantized, qtype)})
    tensor = GGUFFile.open(path).read_tensor("w")
    assert tensor.dtype == torch.float32 and tensor.shape == (8, 96)
    # Exactly what gguf decodes, and within one quantization step of the source (blocks of 32).
    assert torch.equal(tensor, torch.from_numpy(gguf.quants.dequantize(quantized, qtype)))
    blocks = source.reshape(-1, 32)
    step = (np.abs(blocks).max(1) if levels != 15 else blocks.max(1) - blocks.min(1)) / levels
    error = np.abs(tensor.numpy().reshape(-1, 32) - blocks).max(1)
    assert np.all(error <= step * 1.01 + 1e-6)


def _reference_q4_k(block: bytes) -> np.ndarray:
    """ggml's dequantize_row_q4_K for one 256-value block, written out loop by loop."""
    d, dmin = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    scales, qs = block[4:16], block[16:144]
    out = []
    for j in range(8):  # 8 sub-blocks of 32; 6-bit scale and min packed into 12 bytes
        if j < 4:
            scale, minimum = scales[j] & 63, scales[j + 4] & 63
        else:
            scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
            minimum = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
        chunk = qs[32 * (j // 2): 32 * (j // 2) + 32]
        nibbles = [q & 0xF for q in chunk] if j % 2 == 0 else [q >> 4 for q in chunk]
        out += [d * scale * q - dmin * minimum for q in nibbles]
    return np.array(out, dtype=np.float32)


def _reference_q6_k(block: bytes) -> np.ndarray:
    """ggml's dequantize_row_q6_K for one 256-value block."""
    ql, qh = block[:128], block[128:192]
    scales = np.frombuffer(block[192:208], dtype=np.int8)
    d = np.frombuffer(block[208:210], dtype=np.float16).astype(np.float32)[0]
    out = np.zeros(256, dtype=np.float32)
    for half in range(2):
        lo, hi, sc = ql[64 * half:], qh[32 * half:], scales[8 * half:]
        for i in range(32):
            q = [(lo[i] & 0xF) | (((hi[i] >> 0) & 3) << 4), (lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4),
                 (lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4), (lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)]
            for k in range(4):
                out[128 * half + 32 * k + i] = d * sc[i // 16 + 2 * k] * (q[k] - 32)
    return out


def _random_k_blocks(qtype, num_blocks, rng):
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-2, size=(num_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == QType.Q4_K:
        raw[:, :4] = scale  # d, dmin
    else:
        raw[:, -2:] = scale[:, :2]  # d is the last field of a Q6_K block
    return raw


@pytest.mark.parametrize("qtype, reference", [(QType.Q4_K, _reference_q4_k), (QType.Q6_K, _reference_q6_k)])
def test_k_quant_types(tmp_path, qtype, reference):
    rows, blocks_per_row = 3, 2
    raw = _random_k_blocks(qtype, rows * blocks_per_row, np.random.default_rng(7))
    path = write_gguf(tmp_path / "k.gguf", "llama", {}, {"w": (raw.reshape(rows, -1), qtype)})
    tensor = GGUFFile.open(path).read_tensor("w")
    assert tensor.dtype == torch.float32 and tensor.shape == (rows, 256 * blocks_per_row)
    expected = np.concatenate([reference(bytes(block)) for block in raw]).reshape(rows, -1)
    np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_unsupported_type_names_tensor_type_and_file(tmp_path):
    path = write_gguf(tmp_path / "i.gguf", "llama", {}, {"blk.0.attn_q.weight": (np.zeros((4, 32), np.int32), None)})
    with pytest.raises(ConfigError, match=r"i\.gguf.*blk\.0\.attn_q\.weight.*I32"):
        GGUFFile.open(path).read_tensor("blk.0.attn_q.weight")


# --- corrupt files ----------------------------------------------------------------------------

def test_truncated_header(tmp_path):
    path = tmp_path / "cut.gguf"
    with open(SMOLLM2, "rb") as f:
        path.write_bytes(f.read(300_000))  # ends inside the vocabulary metadata
    with pytest.raises(ConfigError, match=r"cut\.gguf: truncated or corrupt GGUF \(.+\)"):
        load_checkpoint(str(path))


def test_truncated_tensor_data(tmp_path):
    path = write_gguf(tmp_path / "short.gguf", "llama", {}, {"w": (_source((16, 32)), None)})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=r"short\.gguf: truncated or corrupt GGUF \(tensor w ends at byte"):
        GGUFFile.open(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 10])
def test_garbage_is_config_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=r"bad\.gguf: truncated or corrupt GGUF"):
        load_checkpoint(str(path))


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gpt2", {"gpt2.block_count": 1}, {"w": (_source((4, 32)), None)})
    with pytest.raises(ConfigError, match=r"g\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(str(path))


# --- tiny HF models written as llama.cpp would -------------------------------------------------

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name):
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF['.'.join(module)]}.{kind}"


def _llama_cpp_permute(weights, num_heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotary halves -> interleaved pairs."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_hf_model_as_gguf(path, arch, hf_config, state_dict, qtypes=None, quantize=gguf.quants.quantize):
    """The model as llama.cpp's converter writes it; `qtypes`: GGUF name -> block type to store
    that tensor in (`quantize(array, qtype)`: the gguf package's, as llama-quantize does), others
    in float32."""
    c = hf_config
    metadata = {
        f"{arch}.block_count": c.num_hidden_layers, f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size, f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.rope.freq_base": 50000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    tensors = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.numpy()
        if arch == "llama" and "q_proj" in name:
            array = _llama_cpp_permute(array, c.num_attention_heads)
        if arch == "llama" and "k_proj" in name:
            array = _llama_cpp_permute(array, c.num_key_value_heads)
        qtype = (qtypes or {}).get(_gguf_name(name))
        array = np.ascontiguousarray(array)
        tensors[_gguf_name(name)] = (quantize(array, qtype), qtype) if qtype else (array, None)
    return write_gguf(path, arch, metadata, tensors)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_hf_model_round_trip(tmp_path, arch, tied):
    import transformers

    cls_config, cls_model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    hf_config = getattr(transformers, cls_config)(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(0)
    state_dict = getattr(transformers, cls_model)(hf_config).state_dict()
    path = write_hf_model_as_gguf(tmp_path / f"{arch}.gguf", arch, hf_config, state_dict)

    checkpoint = load_checkpoint(str(path))
    ours = dict(checkpoint.iter_tensors())
    expected = {n: t for n, t in state_dict.items() if not (tied and n == "lm_head.weight")}
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    config = checkpoint.config
    assert (config.architecture, config.tie_word_embeddings, config.attention_bias) == (arch, tied, arch == "qwen2")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (96, 64, 96)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (50000.0, 1e-5, 256)


def _minimal_llama_metadata(context_length=131072):
    return {"llama.block_count": 1, "llama.context_length": context_length, "llama.embedding_length": 256,
            "llama.feed_forward_length": 512, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
            "llama.rope.freq_base": 500000.0}


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.1+ GGUFs store llama3 rope scaling as divisors; transformers' llama3 init is the reference."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf_config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                                         rope_parameters=rope)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    default_inv_freq = 500000.0 ** -(torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    divisors = (default_inv_freq / inv_freq.double()).float().numpy()
    tensors = {"rope_freqs.weight": (divisors, None), "token_embd.weight": (_source((32, 256)), None)}
    path = write_gguf(tmp_path / "l3.gguf", "llama", _minimal_llama_metadata(), tensors)
    checkpoint = load_checkpoint(str(path))
    scaling = checkpoint.config.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == ("llama3", 32.0, 1, 4)
    assert scaling.original_max_position_embeddings == 8192
    assert [name for name, _ in checkpoint.iter_tensors()] == ["model.embed_tokens.weight"]

    tensors["rope_freqs.weight"] = (np.linspace(1, 8, 64, dtype=np.float32), None)
    path = write_gguf(tmp_path / "odd.gguf", "llama", _minimal_llama_metadata(), tensors)
    with pytest.raises(ConfigError, match=r"odd\.gguf: rope_freqs tensor does not match llama3 rope scaling"):
        load_checkpoint(str(path))
