"""Prepacked linear weights (our panel kernel, oneDNN's layout) against a float64 matmul."""
import threading
import time

import pytest
import torch

from shardserve.layers.activation import silu_and_mul
from shardserve.layers.cpu_kernels import load_panel_linear
from shardserve.layers.linear import Linear, prepack_weight

# bf16: the float32 sum rounded once to bf16 (one rounding step, 2^-8 relative); float32: sums
# in another order than float64's
TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 1e-5}


def reference(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def needs_panel_kernel(dtype):
    return pytest.mark.skipif(load_panel_linear(dtype) is None, reason=f"no toolchain, or this CPU has no panel kernel for {dtype}")


DTYPES = [pytest.param(dtype, marks=needs_panel_kernel(dtype)) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 40, 7), (13, 33, 576), (40, 96, 130), (101, 50, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_kernel_matches_the_exact_product(dtype, rows, out_features, in_features, with_bias):
    """Tails of every kind: odd K, N not a multiple of the panel (32 or 16 columns), M not a
    multiple of the register block (12 or 6 rows) nor of a thread's row chunk (96 or 48)."""
    torch.manual_seed(0)
    x = torch.randn(rows, in_features, dtype=dtype)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype) if with_bias else None
    packed = prepack_weight(weight)
    assert packed.panel_kernel is not None
    got = packed.linear(x, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), reference(x, weight, bias), rtol=TOLERANCE[dtype], atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_kernel_row_does_not_depend_on_the_batch(dtype):
    torch.manual_seed(1)
    weight = torch.randn(70, 64, dtype=dtype)
    batch = torch.randn(130, 64, dtype=dtype)  # more rows than a thread's chunk
    packed = prepack_weight(weight)
    together = packed.linear(batch, None)
    for row in (0, 12, 47, 48, 100, 129):
        assert torch.equal(packed.linear(batch[row : row + 1], None), together[row : row + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 13, 33, 130])
def test_fused_epilogues_give_the_bits_of_the_separate_ops(dtype, rows):
    """silu_mul: SwiGLU in the matmul's last pass; linear_float: the logits head's widening. Rows
    past a register block, a tile block (32) and a thread's chunk (96 or 128)."""
    packed = prepack_weight(torch.randn(2 * 64, 100, dtype=dtype) * 0.3)
    head = prepack_weight(torch.randn(50, 100, dtype=dtype))  # N not whole panels
    if not packed.fused:
        pytest.skip("this build has no fused epilogues (AVX2)")
    torch.manual_seed(4)
    x = torch.randn(rows, 100, dtype=dtype) * 2
    assert packed.fuses_silu_mul
    fused = packed.silu_mul(x)
    assert fused.dtype == dtype and torch.equal(fused, silu_and_mul(packed.linear(x, None)))
    logits = head.linear_float(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, head.linear(x, None).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_argmax_is_torch_argmax_of_the_logits(dtype, threads):
    """Greedy decoding's fused head: the first index of the largest logit (ties between equal
    columns, a NaN column, N not whole panels, rows past a tile block and a thread's chunk) with
    the panels split over one or two threads."""
    torch.manual_seed(5)
    n = 3000 + 17
    weight = torch.randn(n, 64, dtype=dtype)
    weight[2500] = weight[700]  # equal columns: the earlier must win wherever they are the largest
    head = prepack_weight(weight)
    nan_head = prepack_weight(torch.cat([weight[:n - 5], torch.full((5, 64), float("nan"), dtype=dtype)]))
    if not head.fused:
        pytest.skip("this build has no fused epilogues (AVX2)")
    x = torch.randn(130, 64, dtype=dtype)
    x[::7] = weight[700] * 2  # rows whose largest logits are the tied pair
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 13, 33, 130):
            expected = head.linear_float(x[:rows]).argmax(dim=-1)
            got = head.linear_argmax(x[:rows])
            assert got.dtype == torch.int64 and torch.equal(got, expected)
        assert (head.linear_argmax(x)[::7] == 700).all()
        assert (nan_head.linear_argmax(x) == n - 5).all()  # as torch.argmax: the first NaN
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_refused_for_halves_that_are_not_whole_panels(dtype):
    packed = prepack_weight(torch.randn(2 * 40, 64, dtype=dtype))
    assert not packed.fuses_silu_mul
    if packed.fused:
        with pytest.raises(RuntimeError, match="whole panels"):
            packed.silu_mul(torch.randn(3, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_the_same_result_before_and_after_prepack(dtype):
    torch.manual_seed(2)
    layer = Linear(48, [32, 16], True, dtype)
    weight, bias = torch.randn(48, 48, dtype=dtype), torch.randn(48, dtype=dtype)
    layer.weight.weight_loader(layer.weight, weight[:32], 0)
    layer.weight.weight_loader(layer.weight, weight[32:], 1)
    layer.bias.weight_loader(layer.bias, bias, None)
    x = torch.randn(2, 5, 48, dtype=dtype)  # leading dims kept
    tol = 4 * TOLERANCE[dtype]
    torch.testing.assert_close(layer(x).double(), reference(x, weight, bias), rtol=tol, atol=tol)
    layer.prepack()
    after = layer(x)
    assert after.shape == (2, 5, 48)
    torch.testing.assert_close(after.double(), reference(x, weight, bias), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(40, 7), (96, 576), (33, 130)])
def test_rows_reads_the_packed_matrix_back_bit_for_bit(dtype, out_features, in_features):
    # a tied embedding looks its tokens up in the head's panels, padding in both dimensions included
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = prepack_weight(weight)
    assert packed.gathers_rows
    ids = torch.tensor([0, out_features - 1, 31, 32, 5, 5])
    got = packed.rows(ids)
    assert got.is_contiguous() and torch.equal(got, weight[ids])


@pytest.mark.parametrize("dtype", [DTYPES[1]])
def test_panel_kernel_lets_other_python_threads_run(dtype):
    """A server runs the engine in a thread beside its HTTP event loop: while a product runs, that
    loop must still get the GIL. Counts another thread's iterations inside the calls' spans:
    holding the GIL for a whole call left only a few at the spans' edges (7 in 86 ms; 279 with it
    released)."""
    torch.manual_seed(3)
    packed = prepack_weight(torch.randn(8192, 2048, dtype=dtype))
    x = torch.randn(256, 2048, dtype=dtype)
    spans, done = [], threading.Event()

    def products():
        for _ in range(8):
            start = time.perf_counter()
            packed.linear(x, None)
            spans.append((start, time.perf_counter()))
        done.set()

    ticks = []
    worker = threading.Thread(target=products)
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.0002)
    worker.join()
    inside = sum(start < t < end for t in ticks for start, end in spans)
    assert inside >= 50, f"{inside} ticks during {sum(e - s for s, e in spans) * 1e3:.0f} ms of products"
