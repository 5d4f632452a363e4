"""engine/model_loader.py's rules that need no model: what a checkpoint's weights are kept in."""
import pytest
import torch

from shardserve.engine.model_loader import quantization_for

CPU, GPU = torch.device("cpu"), torch.device("meta")  # any device that is not a CPU


@pytest.mark.parametrize("requested, checkpoint, device, kept_in", [
    (None, "gguf", CPU, "gguf"),  # a .gguf implies its blocks, as in vLLM
    (None, "gguf", GPU, None),  # no block kernels there: dequantized to the dtype
    ("none", "gguf", CPU, None),  # asked for the dtype
    (None, "hf", CPU, None),  # an HF folder of floats
    ("int8", "gguf", CPU, "int8"),  # what is asked for wins
    ("gguf", "gguf", CPU, "gguf"),
])
def test_what_the_weights_are_kept_in(requested, checkpoint, device, kept_in):
    assert quantization_for(requested, checkpoint, device) == kept_in
