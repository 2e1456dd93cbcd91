"""The Triton cast-transpose kernels against the readable quantizer, bit for bit, in Triton's CPU interpreter.

Run by ``test_kernels.py`` in a process of its own: Triton's interpreter must be switched on
(``TRITON_INTERPRET=1``) before anything imports Triton, which in the test session has happened long before.

``kernels/cast_transpose.py`` writes every FP8 layout of an operand from one read; ``quantize.py`` is the
definition. Here each kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``: the same kernel code,
executed with numpy on the CPU) and every output is compared with the eager quantizer's bits: FP8 data,
scale-inverses, amax, the padding the GEMMs need, and the FP8 counters. The FP8 cast itself is checked on
all 65,536 bf16 and fp16 bit patterns. The GPU's own run of the same kernels is checked by the GPU check's
parity part (``benchmarks/gpu/part_parity.py``) against the CPU's reference bits.

The interpreter is slow (numpy per tile), so shapes are small; they still hit partial tiles, padding rows,
zero, tiny, inf and NaN groups.
"""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/fp8/test_kernels.py (needs TRITON_INTERPRET=1 before Triton is imported)",
                allow_module_level=True)

from nemo_fp8rl.fp8 import Fp8LinearState, fp8_linear, fused, get_recipe, quantize  # noqa: E402
from nemo_fp8rl.fp8 import kernels  # noqa: E402
from nemo_fp8rl.fp8.formats import get_format  # noqa: E402
from nemo_fp8rl.fp8.quantize import Fp8Stats  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    return kernels.ops()


@pytest.fixture(autouse=True)
def _eager_reference():
    with fused.compile_mode_set("false"):  # the reference is the eager quantizer
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits; two NaNs count as equal whatever their sign or payload."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((_bits(a) == _bits(b)) | both_nan).all())


def _edge(rows: int, cols: int, dtype: torch.dtype, seed: int = 3) -> torch.Tensor:
    """Random values with an all-zero 128x128 tile / 1x128 block, a tiny-amax row, a saturating value,
    ties of the FP8 grid, and (in the last rows) inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 3
    x[:128, :128] = 0.0
    x[130, :] *= 1e-38
    x[131, 5] = 1e6
    x[132, :8] = torch.tensor([0.5625, 0.59375, -1.0625, 17.0, 18.0, -0.001953125 * 1.5, 2.0**-7 * 1.5, -0.0])
    return x.to(dtype)


# ------------------------------------------------------------------------------------------------------
# the FP8 cast (integer bit operations in the kernel)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_matches_torch_on_every_16_bit_pattern(ops, fmt, dtype):
    """scale 1 given: q = fp8(clamp(x, -M, M)) for all 65,536 patterns (ties, +-0, subnormals, NaN, inf)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    f = get_format(fmt)
    q, qt, sinv, amax = ops.cast_transpose_tensorwise(x, fmt, scale=torch.tensor(1.0), col_pad=1)
    ref = torch.clamp(x.float(), -f.max, f.max).to(f.dtype)
    assert _same(q, ref)
    assert _same(qt, ref.t().contiguous())
    assert float(sinv) == 1.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_matches_torch_where_rounding_carries_into_the_exponent(ops, fmt):
    """float32 values just below each power of two and halfway points (the interpreter's own float8 cast
    gets -124.2 -> -64 wrong; ours must give torch's -128)."""
    f = get_format(fmt)
    p = torch.tensor([2.0 ** e for e in range(-20, 17)])
    x = torch.cat([p * (1 - 2.0**-6), p * (1 - 2.0**-4), -p * 0.97, p * 1.0625, p * 1.1875, torch.tensor([-124.2])])
    x = torch.cat([x, torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100])
    x = x[: (x.numel() // 16) * 16].reshape(16, -1)
    q, _, _, _ = ops.cast_transpose_tensorwise(x, fmt, scale=torch.tensor(1.0), write_col=False)
    assert _same(q, torch.clamp(x, -f.max, f.max).to(f.dtype))


# ------------------------------------------------------------------------------------------------------
# per-tensor scales (tensorwise, delayed)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,pow2,eps,margin", [("e4m3", False, 0.0, 0), ("e5m2", True, 0.0, 0),
                                                ("e4m3", False, 1e-12, 1)])
@pytest.mark.parametrize("special", ["finite", "inf", "nan", "zero", "tiny"])
def test_tensorwise_current_scale_is_the_reference(ops, dtype, fmt, pow2, eps, margin, special):
    """q, q^T (zero-padded to 16 columns), scale_inv and amax equal quantize(x, 'tensor') on edge tensors."""
    x = _edge(150, 96, torch.float32)[:150]
    if special == "inf":
        x[140, 3] = float("inf")
    elif special == "nan":
        x[141, 7] = float("nan")
    elif special == "zero":
        x.zero_()
    elif special == "tiny":
        x = x * 1e-39
    x = x.to(dtype)
    stats_k, stats_r = Fp8Stats(), Fp8Stats()
    q, qt, sinv, amax = ops.cast_transpose_tensorwise(x, fmt, pow2=pow2, eps=eps, margin=margin, col_pad=16,
                                                     stats=stats_k)
    from nemo_fp8rl.fp8.quantize import _quantize_impl

    data, s, amax_ref = _quantize_impl(x, get_format(fmt), "tensor", 1, pow2, margin, eps, 32, None, stats_r,
                                       False, False, torch.float32)
    assert _same(q, data)
    assert _same(sinv, (1.0 / s).reshape(()))
    assert _same(amax, amax_ref.float().reshape(()))
    assert qt.shape == (96, 160)
    assert _same(qt[:, :150], data.t().contiguous()) and bool((_bits(qt[:, 150:]) == 0).all())
    for k in ("saturated", "numel", "nonfinite_amax"):
        assert torch.equal(getattr(stats_k, k), getattr(stats_r, k)), k


def test_tensorwise_strided_input_reads_in_place(ops):
    """A transposed view is read through its strides: the same bits as its contiguous copy."""
    x = _edge(160, 144, torch.bfloat16)
    a = ops.cast_transpose_tensorwise(x.t(), "e4m3")
    b = ops.cast_transpose_tensorwise(x.t().contiguous(), "e4m3")
    assert all(_same(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_given_scale_counts_saturation_and_records_amax(ops, fmt):
    """A given (delayed) scale: the same q, amax of this tensor (what the history records), and the
    saturated / non-finite counters of the eager quantizer."""
    x = _edge(140, 64, torch.bfloat16)
    x[139, 1] = float("inf")
    scale = torch.tensor(300.0)  # large: many values saturate
    sk, sr = Fp8Stats(), Fp8Stats()
    q, qt, sinv, amax = ops.cast_transpose_tensorwise(x, fmt, scale=scale, stats=sk)
    from nemo_fp8rl.fp8.quantize import _quantize_impl

    data, s, amax_ref = _quantize_impl(x, get_format(fmt), "tensor", 1, False, 0, 0.0, 32, scale, sr, False, False,
                                       torch.float32)
    assert _same(q, data) and _same(sinv, (1.0 / s).reshape(())) and _same(amax, amax_ref.float().reshape(()))
    assert int(sk.saturated) > 0
    for k in ("saturated", "numel", "nonfinite_amax"):
        assert torch.equal(getattr(sk, k), getattr(sr, k)), k


# ------------------------------------------------------------------------------------------------------
# block scales (blockwise)
# ------------------------------------------------------------------------------------------------------


def _ref_1x128(x: torch.Tensor, fmt: str, pow2: bool, eps: float, dim: int):
    """Reference 1x128 quantization of x along ``dim``: ``(data [R', C'] with the blocks along the last
    dim, scale_inv [R', C'/128])``, x transposed first for dim 0."""
    t = x if dim == 1 else x.t()
    pad = (-t.shape[1]) % 128
    t = torch.nn.functional.pad(t, (0, pad)) if pad else t
    data, sinv = quantize(t, fmt, (1, 128), dim=1, pow2_scales=pow2, eps=eps)
    return data.reshape(t.shape[0], -1), sinv[..., 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,pow2,eps", [("e4m3", True, 0.0), ("e5m2", True, 0.0), ("e4m3", False, 1e-12)])
def test_blockwise_both_layouts_are_the_reference(ops, dtype, fmt, pow2, eps):
    """Row layout (1x128 along C, rows padded to 4 with zeros) and column layout (1x128 along R = the
    tokens, transposed, padded to 128) from one launch equal two reference quantizations, scales in
    torch's column-major layout, counters as the reference's two quantizations count them."""
    x = _edge(261, 256, torch.float32)
    x[200, 9] = float("inf")
    x[250, 17] = float("nan")
    x = x.to(dtype)
    sk = Fp8Stats()
    row, col = ops.cast_transpose_blockwise(x, fmt, pow2=pow2, eps=eps, stats=sk)
    d_r, s_r = _ref_1x128(x, fmt, pow2, eps, dim=1)
    q, sq = row
    assert q.shape == (264, 256) and sq.shape == (264, 2) and sq.stride() == (1, 264)
    assert _same(q[:261], d_r) and bool((_bits(q[261:]) == 0).all())
    # padding rows: zeros, whatever their (finite) scale: scale 1 without eps, as backends._pad_rows writes
    assert _same(sq[:261], s_r) and bool(torch.isfinite(sq[261:]).all()) and (eps > 0 or bool((sq[261:] == 1).all()))
    d_c, s_c = _ref_1x128(x, fmt, pow2, eps, dim=0)
    qt, sqt = col
    assert qt.shape == (256, 384) and sqt.shape == (256, 3) and sqt.stride() == (1, 256)
    assert _same(qt, d_c) and _same(sqt, s_c)
    sr = Fp8Stats()
    quantize(x, fmt, (1, 128), dim=1, pow2_scales=pow2, eps=eps, stats=sr)
    quantize(torch.nn.functional.pad(x.t(), (0, 123)), fmt, (1, 128), dim=1, pow2_scales=pow2, eps=eps, stats=sr)
    assert torch.equal(sk.numel, sr.numel) and torch.equal(sk.nonfinite_amax, sr.nonfinite_amax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
def test_weight_tiles_and_their_transpose_are_the_reference(ops, dtype, pow2):
    """128x128 tiles of W and W^T (same scale per tile) with torch's padded scale layouts."""
    w = _edge(384, 640, torch.float32)
    w[300, 600] = float("nan")
    w = w.to(dtype)
    (q, s), (qt, st) = ops.cast_weight_tiles(w, "e4m3", pow2=pow2)
    data, sinv = quantize(w, "e4m3", (128, 128), pow2_scales=pow2)  # [3, 5, 128, 128], [3, 5, 1, 1]
    ref = data.permute(0, 2, 1, 3).reshape(384, 640)
    tiles = sinv[:, :, 0, 0]  # [N/128, K/128]
    assert _same(q, ref) and _same(qt, ref.t().contiguous())
    assert s.shape == (8, 3) and s.stride() == (1, 8)  # [L4, N/128]: K/128 = 5 padded to 8
    assert _same(s[:5], tiles.t().contiguous()) and bool((s[5:] == 1).all())
    assert st.shape == (4, 5) and st.stride() == (1, 4)  # [LT4, K/128]: N/128 = 3 padded to 4
    assert _same(st[:3], tiles.contiguous()) and bool((st[3:] == 1).all())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_bf16_dequantized_layouts_are_exact_with_pow2_scales(ops, fmt):
    """``fp8_format=hybrid`` runs dgrad/wgrad as bf16 GEMMs of dequantized operands. With power-of-two
    scales q * 2^-k is a bf16 value (q has <= 4 significant bits): the bf16 outputs equal the float32
    dequantized reference exactly (groups of normal magnitude; see ``hybrid_blockwise_refusal``)."""
    x = _edge(200, 256, torch.bfloat16)[:, :256].clone()
    x[130] = 1.0  # drop the 1e-38 row: below bf16's subnormal range the bf16 value would round
    row, col = ops.cast_transpose_blockwise(x, fmt, pow2=True, row_bf16=True, col_bf16=True)
    d_r, s_r = _ref_1x128(x, fmt, True, 0.0, dim=1)
    deq_r = (d_r.float().reshape(200, 2, 128) * s_r[..., None]).reshape(200, 256)
    assert row.dtype == torch.bfloat16 and torch.equal(row.float(), deq_r)
    d_c, s_c = _ref_1x128(x, fmt, True, 0.0, dim=0)
    deq_c = (d_c.float().reshape(256, 2, 128) * s_c[..., None]).reshape(256, 256)[:, :200].t()
    assert col.shape == (200, 256) and torch.equal(col.float(), deq_c)
    w = _edge(256, 384, torch.bfloat16)
    w[130] = 1.0
    _, w_hat = ops.cast_weight_tiles(w, "e4m3", pow2=True, transpose_bf16=True)
    data, sinv = quantize(w, "e4m3", (128, 128), pow2_scales=True)
    ref = (data.float() * sinv).permute(0, 2, 1, 3).reshape(256, 384)
    assert w_hat.dtype == torch.bfloat16 and torch.equal(w_hat.float(), ref)


# ------------------------------------------------------------------------------------------------------
# row scales (rowwise): per row of x and per column of x (the rows of x^T)
# ------------------------------------------------------------------------------------------------------


def _row_stats_ref(x: torch.Tensor, fmt: str, pow2: bool, eps: float, row: bool = True, col: bool = True) -> Fp8Stats:
    """The counters of the reference path's two quantizations (x along C, x^T along R)."""
    st = Fp8Stats()
    if row:
        quantize(x, fmt, "row", dim=1, pow2_scales=pow2, eps=eps, stats=st)
    if col:
        quantize(x.t(), fmt, "row", dim=1, pow2_scales=pow2, eps=eps, stats=st)
    return st


def _same_stats(a: Fp8Stats, b: Fp8Stats) -> bool:
    return all(torch.equal(getattr(a, k).cpu(), getattr(b, k).cpu()) for k in ("saturated", "numel", "nonfinite_amax"))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [True, False])
def test_rowwise_on_every_16_bit_pattern(ops, fmt, dtype, pow2):
    """All 65,536 patterns (ties, +-0, subnormals, inf, NaN) as a [256, 256] tensor in three arrangements
    (rows = high byte, rows = low byte, a fixed shuffle), so each pattern is cast under many row and column
    scales, from tiny to huge amaxes and the inf/NaN groups that get scale 1: both layouts, both scale
    vectors and the counters equal the reference's bits."""
    pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(1))
    for arrangement in (pats.reshape(256, 256), pats.reshape(256, 256).t(), pats[perm].reshape(256, 256)):
        x = arrangement.contiguous().view(dtype)
        sk = Fp8Stats()
        got = ops.cast_transpose_rowwise(x, fmt, pow2=pow2, stats=sk)
        from nemo_fp8rl.fp8.kernels import reference as ref

        assert ref.same_bytes(got, ref.rowwise_layouts(x, fmt, pow2=pow2))
        assert _same_stats(sk, _row_stats_ref(x, fmt, pow2, 0.0))


def _row_edge(rows: int, cols: int, dtype: torch.dtype, special: str) -> torch.Tensor:
    """``_edge`` plus an all-zero row and column, a row and a column of subnormal-size values (their scale
    overflows to inf and is capped), a saturating value, and by ``special``: inf / NaN in one row and one
    column, every element zero, or every element tiny."""
    x = _edge(rows, cols, torch.float32, seed=7)
    x[140] = 0.0
    x[:, 11] = 0.0
    x[:, 12] *= 1e-40
    x[135, 20] = -3e5
    if special == "inf":
        x[150, 3] = float("inf")
        x[141, 30] = -float("inf")
    elif special == "nan":
        x[151, 7] = float("nan")
        x[200, 40] = float("nan")
    elif special == "zero":
        x.zero_()
    elif special == "tiny":
        x = x * 1e-39
    return x.to(dtype)


@pytest.mark.parametrize("dtype,fmt,pow2,eps", [
    (torch.bfloat16, "e4m3", True, 0.0), (torch.bfloat16, "e5m2", True, 0.0), (torch.bfloat16, "e4m3", False, 0.0),
    (torch.float32, "e4m3", True, 0.0), (torch.float32, "e4m3", True, 1e-12), (torch.float16, "e5m2", False, 0.0)])
@pytest.mark.parametrize("special", ["finite", "inf", "nan", "zero", "tiny"])
def test_rowwise_both_layouts_are_the_reference(ops, dtype, fmt, pow2, eps, special):
    """Row layout (q [R, C], scale_inv [R, 1]) and column layout (q^T [C, RT] zero-padded to 16 columns,
    scale_inv [C, 1]) equal ``quantize(x, "row")`` and ``quantize(x.t(), "row")`` on edge tensors with
    partial tiles (261 x 200), counters as the reference's two quantizations count them."""
    from nemo_fp8rl.fp8.kernels import reference as ref

    x = _row_edge(261, 200, dtype, special)
    sk = Fp8Stats()
    row, col = ops.cast_transpose_rowwise(x, fmt, pow2=pow2, eps=eps, stats=sk)
    (q, sq), (qt, sqt) = row, col
    assert q.shape == (261, 200) and sq.shape == (261, 1) and qt.shape == (200, 272) and sqt.shape == (200, 1)
    assert q.dtype == qt.dtype == get_format(fmt).dtype and sq.dtype == sqt.dtype == torch.float32
    d_r, s_r = quantize(x, fmt, "row", dim=1, pow2_scales=pow2, eps=eps)
    d_c, s_c = quantize(x.t(), fmt, "row", dim=1, pow2_scales=pow2, eps=eps)
    assert _same(q, d_r) and _same(sq, s_r)
    assert _same(qt[:, :261], d_c.contiguous()) and bool((_bits(qt[:, 261:]) == 0).all()) and _same(sqt, s_c)
    assert ref.same_bytes((row, col), ref.rowwise_layouts(x, fmt, pow2=pow2, eps=eps))
    assert _same_stats(sk, _row_stats_ref(x, fmt, pow2, eps))
    if special in ("inf", "nan"):  # two rows and two columns; fp16 also overflows on 1e6 and -3e5 (two more each)
        assert int(sk.nonfinite_amax) == (8 if dtype == torch.float16 else 4)


def test_rowwise_one_layout_strided_input_and_weight_padding(ops):
    """``row=False`` / ``col=False`` write the other layout's same bits and count only it; a transposed view
    is read through its strides; ``col_pad=1`` (the weight's W^T) pads nothing."""
    x = _row_edge(210, 96, torch.bfloat16, "nan")
    both = ops.cast_transpose_rowwise(x, "e4m3")
    s_row, s_col = Fp8Stats(), Fp8Stats()
    only_row = ops.cast_transpose_rowwise(x, "e4m3", col=False, stats=s_row)
    only_col = ops.cast_transpose_rowwise(x, "e4m3", row=False, stats=s_col)
    assert only_row[1] is None and only_col[0] is None
    assert all(_same(a, b) for a, b in zip(only_row[0], both[0]))
    assert all(_same(a, b) for a, b in zip(only_col[1], both[1]))
    assert _same_stats(s_row, _row_stats_ref(x, "e4m3", True, 0.0, col=False))
    assert _same_stats(s_col, _row_stats_ref(x, "e4m3", True, 0.0, row=False))
    t = ops.cast_transpose_rowwise(x.t(), "e4m3")
    tc = ops.cast_transpose_rowwise(x.t().contiguous(), "e4m3")
    assert all(_same(a, b) for a, b in zip((*t[0], *t[1]), (*tc[0], *tc[1])))
    w = _row_edge(160, 96, torch.bfloat16, "finite")
    (_, _), (wt, swt) = ops.cast_transpose_rowwise(w, "e4m3", col_pad=1)
    d, s = quantize(w.t(), "e4m3", "row", dim=1, pow2_scales=True)
    assert wt.shape == (96, 160) and _same(wt, d.contiguous()) and _same(swt, s)


def test_rowwise_every_launch_configuration_writes_the_same_bits(ops):
    """The GPU tunes the amax launch and the cast launch separately (cast_transpose._config): every candidate
    of each writes the same bytes, partial tiles and the padding columns included (float32 scales, so a
    wrong amax shows in the scales: a power of two would hide it within a binade). The two launches meet only
    in the amax buffer, which the first writes and the second reads, so each amax candidate is checked with
    one cast tiling and each cast candidate with one amax tiling (2n - 1 pairs of launches, not n^2: a wrong amax
    buffer fails with any cast tiling, a wrong cast with any amax tiling)."""
    from nemo_fp8rl.fp8.kernels import reference as ref

    x = _row_edge(261, 200, torch.bfloat16, "inf")
    want = ref.rowwise_layouts(x, "e4m3", pow2=False)
    first, *rest = ops.TENSOR_CONFIGS
    pairs = [(amax_cfg, first) for amax_cfg in ops.TENSOR_CONFIGS] + [(first, cast_cfg) for cast_cfg in rest]
    for amax_cfg, cast_cfg in pairs:
        got = ops.cast_transpose_rowwise(x, "e4m3", pow2=False, _tiles=cast_cfg, _amax_tiles=amax_cfg)
        assert ref.same_bytes(got, want), (amax_cfg, cast_cfg)


# ------------------------------------------------------------------------------------------------------
# the linear: kernel path against the reference torch path (CPU scaled GEMM: per-tensor scales)
# ------------------------------------------------------------------------------------------------------


def _run_linear(recipe_name: str, kernel: bool, monkeypatch, steps: int = 2, **overrides):
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret" if kernel else "0")
    torch.manual_seed(0)
    rec = get_recipe(recipe_name, **overrides)
    w = (torch.randn(96, 64) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.randn(96).to(torch.bfloat16).requires_grad_()
    state = Fp8LinearState(rec)
    outs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(3, 33, 64, generator=g) * 2).to(torch.bfloat16).requires_grad_()
        y = fp8_linear(x, w, b, rec, state, backend="torch")
        gy = torch.randn(y.shape, generator=g).to(torch.bfloat16)
        y.backward(gy)
        outs += [y.detach(), x.grad, w.grad.clone(), b.grad.clone()]
        w.grad = b.grad = None
    outs += [state.stats.saturated.cpu(), state.stats.numel.cpu(), state.stats.nonfinite_amax.cpu()]
    if rec.scaling == "delayed":
        outs += [m.amax_history.cpu() for m in state.delayed.values()] + [m.scale.cpu() for m in state.delayed.values()]
    return outs


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed"])
def test_kernel_linear_equals_the_reference_torch_path(recipe_name, monkeypatch, ops):
    """Forward, dgrad, wgrad (in the weight's dtype), bias grad, counters and delayed history: the same
    bits from the kernel path as from the reference path (same FP8 operands into the same GEMMs)."""
    from nemo_fp8rl.fp8 import torch_linear

    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret")
    assert torch_linear.kernel_path_refusal(get_recipe(recipe_name), "cpu") is None
    ref = _run_linear(recipe_name, False, monkeypatch)
    got = _run_linear(recipe_name, True, monkeypatch)
    assert got[2].dtype == torch.bfloat16  # wgrad straight in the parameter's dtype
    for i, (a, b) in enumerate(zip(ref, got)):
        assert _same(a, b), f"output {i} differs"


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_rowwise_kernel_linear_equals_the_reference_torch_path(fmt, monkeypatch, ops):
    """rowwise (E4M3, and E5M2 gradients: torch's row-wise GEMMs take either): forward, dgrad, wgrad, bias grad
    and counters of the kernel path equal the reference path's bits over two steps. torch's CPU scaled GEMM
    has no row-wise scaling, so both paths run the readable reference of torch's kernel
    (``tests/_scaled_mm_reference.py``: torch's CUDA argument rules, then exact float64 products rounded once),
    which reads each scale where torch documents it; the kernel path's prepared arguments also pass torch's
    own CUDA meta checks. A second backward through ``retain_graph`` gives the same gradients."""
    from nemo_fp8rl.fp8 import backends, torch_linear
    from tests._scaled_mm_reference import cuda_meta_check, reference_kernel

    calls = []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret")
    rec = get_recipe("rowwise", fp8_format=fmt)
    assert torch_linear.kernel_path_refusal(rec, "cpu") is None
    ref = _run_linear("rowwise", False, monkeypatch, fp8_format=fmt)
    n_ref = len(calls)
    launched = []
    real_cast = ops.cast_transpose_rowwise
    monkeypatch.setattr(ops, "cast_transpose_rowwise", lambda x, *a, **kw: (launched.append(tuple(x.shape)),
                                                                            real_cast(x, *a, **kw))[1])
    got = _run_linear("rowwise", True, monkeypatch, fp8_format=fmt)
    assert sorted(set(launched)) == [(96, 64), (99, 64), (99, 96)] and len(launched) == 6  # x, W, dy per step
    assert n_ref == 6 and len(calls) == 12  # fprop, dgrad, wgrad per step, every one on the (reference) kernel
    assert got[2].dtype == torch.bfloat16
    for i, (a, b) in enumerate(zip(ref, got)):
        assert _same(a, b), f"output {i} differs"
    cuda_meta_check(calls[n_ref:])
    assert all(c[3] == c[5] == torch.nn.functional.ScalingType.RowWise for c in calls[n_ref:])
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 64, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    x = torch.randn(70, 64, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(70, 96, generator=g).to(torch.bfloat16)
    y = torch_linear._Fp8KernelLinearFn.apply(x, w, None, rec, Fp8LinearState(rec), True)
    first = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(y, (x, w), dy)))


def test_hybrid_blockwise_with_fp32_scales_is_refused_not_run_slowly():
    from nemo_fp8rl.fp8.linear import layer_backend
    from nemo_fp8rl.fp8.torch_linear import hybrid_blockwise_refusal

    rec = get_recipe("blockwise", fp8_format="hybrid", pow2_scales=False)
    assert "pow2_scales" in hybrid_blockwise_refusal(rec)
    assert hybrid_blockwise_refusal(get_recipe("blockwise", fp8_format="hybrid")) is None
    # on a CPU torch cannot run blockwise at all: the layer is emulated (counted), not refused
    assert layer_backend(rec, "torch", "cpu", 256, 256)[0] == "emulate"


# ------------------------------------------------------------------------------------------------------
# kernels/reference.py: the readable builds of the kernels' outputs the GPU check compares against
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_module_builds_what_the_kernels_write(ops, fmt):
    """reference.py (used by the GPU parity part) returns the kernels' outputs byte for byte, layouts
    and padding included, for all four launchers and the bf16 (hybrid) outputs."""
    from nemo_fp8rl.fp8.kernels import reference as ref

    x = _edge(261, 256, torch.bfloat16)
    assert ref.same_bytes(ops.cast_transpose_tensorwise(x, fmt), ref.tensorwise_layouts(x, fmt))
    scale = torch.tensor(3.0)
    assert ref.same_bytes(ops.cast_transpose_tensorwise(x, fmt, scale=scale),
                          ref.tensorwise_layouts(x, fmt, scale=scale))
    assert ref.same_bytes(ops.cast_transpose_blockwise(x, fmt), ref.blockwise_layouts(x, fmt))
    assert ref.same_bytes(ops.cast_transpose_rowwise(x, fmt), ref.rowwise_layouts(x, fmt))
    assert ref.same_bytes(ops.cast_transpose_rowwise(x, fmt, pow2=False, col_pad=1),
                          ref.rowwise_layouts(x, fmt, pow2=False, col_pad=1))
    x[130] = 1.0
    assert ref.same_bytes(ops.cast_transpose_blockwise(x, fmt, row_bf16=True, col_bf16=True),
                          ref.blockwise_layouts(x, fmt, row_bf16=True, col_bf16=True))
    w = _edge(256, 384, torch.bfloat16)
    w[130] = 1.0
    for t_bf16 in (False, True):
        assert ref.same_bytes(ops.cast_weight_tiles(w, "e4m3", transpose_bf16=t_bf16),
                              ref.weight_tile_layouts(w, "e4m3", transpose_bf16=t_bf16))


def test_every_launch_configuration_writes_the_same_bits(ops):
    """The GPU picks the fastest tiling per process (cast_transpose._config): each candidate must write
    the same bytes, current and delayed scale, partial tiles included."""
    from nemo_fp8rl.fp8.kernels import reference as ref

    x = _edge(261, 200, torch.bfloat16)
    want_cur = ref.tensorwise_layouts(x, "e4m3")
    want_del = ref.tensorwise_layouts(x, "e5m2", scale=torch.tensor(7.0))
    for cfg in ops.TENSOR_CONFIGS:
        assert ref.same_bytes(ops.cast_transpose_tensorwise(x, "e4m3", _tiles=cfg), want_cur), cfg
        assert ref.same_bytes(ops.cast_transpose_tensorwise(x, "e5m2", scale=torch.tensor(7.0), _tiles=cfg), want_del), cfg


# ------------------------------------------------------------------------------------------------------
# the traffic of one FP8 linear (issue 38's CPU proxy of the GPU's cost around the GEMMs)
# ------------------------------------------------------------------------------------------------------


class _TritonTraffic:
    """Bytes the interpreted Triton kernels load and store (hooks on the interpreter's masked load/store:
    only elements whose mask is true count, as a GPU moves them)."""

    def __init__(self, monkeypatch):
        from triton.runtime import interpreter

        self.loaded = self.stored = 0
        builder = interpreter.InterpreterBuilder
        real_load, real_store = builder.create_masked_load, builder.create_masked_store

        def load(b, ptrs, mask, other, *a):
            out = real_load(b, ptrs, mask, other, *a)
            self.loaded += int(mask.data.sum()) * out.data.dtype.itemsize
            return out

        def store(b, ptrs, value, mask, *a):
            self.stored += int(mask.data.sum()) * value.data.dtype.itemsize
            return real_store(b, ptrs, value, mask, *a)

        monkeypatch.setattr(builder, "create_masked_load", load)
        monkeypatch.setattr(builder, "create_masked_store", store)
        # the interpreter stages each kernel's tensors through host copies (a GPU launch has none): hide
        # those from the torch-op count
        real_run = interpreter.InterpretedFunction.run

        def run(fn, *a, **kw):
            with torch.utils._python_dispatch._disable_current_modes():
                return real_run(fn, *a, **kw)

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)


class _TorchTraffic(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op but the GEMMs and views: its name, and the bytes of its tensor inputs and outputs."""

    GEMMS = ("_scaled_mm", "scaled_mm", "mm", "addmm", "bmm")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name.startswith(self.GEMMS) or func.is_view or name.startswith("empty"):  # empty: allocation, no traffic
            return out
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}, out))
        nbytes = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        self.ops.append((name, nbytes, max((t.numel() for t in flat if isinstance(t, torch.Tensor)), default=0)))
        return out


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
def test_one_fp8_linear_moves_at_most_1_5x_the_ideal_bytes_and_quantizes_the_weight_once(recipe_name, ops,
                                                                                       monkeypatch):
    """bf16, 4 micro-batches of one optimizer step inside fp8_weight_cache, forward + dgrad + wgrad each, on
    the kernel path (CPU: the Triton kernels interpreted; tensorwise on torch's real FP8 GEMM, rowwise, which
    torch's CPU GEMM lacks, on the readable reference of torch's kernel, uncounted as a GEMM is).

    Ideal traffic outside the GEMMs: each bf16 operand read once and each FP8 layout it feeds written once
    (x: x, x^T; dy: dy, dy^T; the weight: W, W^T once per step). Measured: every byte the kernels load or
    store plus every non-GEMM torch op's tensors. Current scaling reads an operand twice (its amax first),
    so 1.5x is where one cast + transpose pass per operand lands (2 + 2 bytes read, 1 + 1 written per
    element against 2 + 1 + 1); the scalar bookkeeping (amax, scales, a few bytes per call) gets 1 KiB.
    rowwise also moves its scale vectors: each program of the cast pass reads the amaxes of its tile's rows
    and columns (4 bytes each: 4 R C (1/BLOCK_C + 1/BLOCK_R) per operand [R, C], 1/8 byte per element at
    64 x 64 tiles), and each row and column has its amax zeroed and its scale-inverse written (8 bytes).
    The reference path (compiled quantizer, ``.t().contiguous()`` copies, the weight re-quantized per call)
    moves more than twice the ideal and copies operands."""
    from nemo_fp8rl.fp8 import backends, fp8_weight_cache

    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret")
    m, k, n, micro = 128, 256, 384, 4
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    from nemo_fp8rl.fp8 import Fp8Linear

    layer = Fp8Linear.from_linear(lin, get_recipe(recipe_name), backend="torch")
    layer.fp8_state.stats = None
    if recipe_name == "rowwise":
        from tests._scaled_mm_reference import reference_kernel

        gemm = reference_kernel([], check=False)

        def hidden_gemm(*a, **kw):  # a GEMM: not an op around it
            with torch.utils._python_dispatch._disable_current_modes():
                return gemm(*a, **kw)

        monkeypatch.setattr(backends, "scaled_mm_kernel", hidden_gemm)
    launcher = "cast_transpose_rowwise" if recipe_name == "rowwise" else "cast_transpose_tensorwise"
    cast_shapes = []
    real_cast = getattr(ops, launcher)
    monkeypatch.setattr(ops, launcher, lambda x, *a, **kw: (cast_shapes.append(tuple(x.shape)), real_cast(x, *a, **kw))[1])
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, k, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(micro)]
    dys = [torch.randn(m, n, generator=g).to(torch.bfloat16) for _ in range(micro)]
    triton_traffic = _TritonTraffic(monkeypatch)
    with fp8_weight_cache(layer), _TorchTraffic() as torch_traffic:
        for x, dy in zip(xs, dys):
            y = layer(x)
            torch.autograd.grad(y, (x, lin.weight), dy)
    operand = min(m * k, m * n, n * k)
    big_copies = [op for op in torch_traffic.ops if op[2] >= operand]
    assert not big_copies, f"torch ops on operand-sized tensors outside the kernels: {big_copies[:8]}"
    assert cast_shapes.count((n, k)) == 1, cast_shapes  # the weight: once per step, not per micro-batch
    assert cast_shapes.count((m, k)) == micro and cast_shapes.count((m, n)) == micro
    ideal = micro * ((2 + 1 + 1) * m * k + (2 + 1 + 1) * m * n) + (2 + 1 + 1) * n * k
    moved = triton_traffic.loaded + triton_traffic.stored + sum(op[1] for op in torch_traffic.ops)
    vectors = 0
    if recipe_name == "rowwise":
        br, bc, _ = ops._DEFAULT["row"]
        shapes = [(m, k), (m, n)] * micro + [(n, k)]
        vectors = sum(4 * r * c * (1 / bc + 1 / br) + 8 * (r + c) for r, c in shapes)
    assert moved <= 1.5 * ideal + vectors + micro * 1024, (moved, ideal, vectors, moved / ideal)
    assert moved >= ideal  # the hooks saw the kernels' traffic at all


def _dequant_prepared(op):
    """float32 values of a prepared operand, from torch's scale layouts (backends.scaled_mm_args)."""
    q = op.data.float()
    if op.granularity == "tensor":
        return q * op.scale_inv
    if tuple(op.granularity) == (1, 128):
        return q * op.scale_inv.repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    tiles = op.scale_inv[: q.shape[1] // 128, :].t()  # [L4, R/128] -> [R/128, K/128]
    return q * tiles.repeat_interleave(128, 0).repeat_interleave(128, 1)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_blockwise_kernel_linear_matches_the_emulation(fmt, monkeypatch):
    """The blockwise kernel path end to end on a CPU (torch's CPU GEMM has no block scaling, so the FP8 GEMM
    is a float32 product of the prepared operands' dequantized values): forward, dgrad, wgrad equal the
    emulation's within ``gemm_error_bound`` (hybrid: bf16 GEMMs of exact bf16 operands), twice, the second
    backward through ``retain_graph``."""
    from nemo_fp8rl.fp8 import torch_linear
    from nemo_fp8rl.fp8.backends import gemm_error_bound

    def gemm(a, b, out_dtype, fast_accum=False, bias=None):
        out = _dequant_prepared(a) @ _dequant_prepared(b).t()
        out = out[: a.rows] if a.rows is not None else out
        return (out if bias is None else out + bias.float()).to(out_dtype)

    monkeypatch.setattr(torch_linear, "scaled_gemm", gemm)
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret")
    rec = get_recipe("blockwise", fp8_format=fmt)
    assert torch_linear.kernel_path_refusal(rec, "cpu") is None
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    x = (torch.randn(130, 384, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    y = torch_linear._Fp8KernelLinearFn.apply(x, w, None, rec, Fp8LinearState(rec), True)
    got = [y, *torch.autograd.grad(y, (x, w), dy, retain_graph=True)]
    again = torch.autograd.grad(y, (x, w), dy)
    assert all(torch.equal(a, b) for a, b in zip(got[1:], again))
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "0")
    ye = fp8_linear(x, w, None, rec, Fp8LinearState(rec), backend="emulate")
    want = [ye, *torch.autograd.grad(ye, (x, w), dy)]
    from nemo_fp8rl.fp8 import quantize_operand

    st = Fp8LinearState(rec)
    hats = [(quantize_operand(x, "input", 1, rec, st, False), quantize_operand(w, "weight", 1, rec, st, False)),
            (quantize_operand(dy, "grad_output", 1, rec, st, False), quantize_operand(w, "weight", 0, rec, st, False).t()),
            (quantize_operand(dy, "grad_output", 0, rec, st, False).t(), quantize_operand(x, "input", 0, rec, st, False).t())]
    for i, ((a, b), out, ref) in enumerate(zip(hats, got, want)):
        assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
        bound = gemm_error_bound(a, b, torch.bfloat16)
        # each differs from the exact product by at most the bound: from each other by at most twice it
        assert bool(((out.double() - ref.double()).abs() <= 2 * bound).all()), f"output {i}"


# ------------------------------------------------------------------------------------------------------
# the rollout's activation quantizers (kernels/vllm_quant.py) against fp8/rollout.py
# ------------------------------------------------------------------------------------------------------


def _vllm_cases(dtype: torch.dtype):
    """(name, x [M, K]) inputs: every 16-bit pattern as 256 rows of 256 (for float32: those of bf16 widened),
    exact ties (below), edge rows (zero, tiny, NaN, inf, saturating, grid ties) with a partial last group and a
    partial row block, and a transposed (strided) view.

    Ties: x / s lands exactly on a midpoint of the E4M3 grid only for special amax/x pairs, which random or
    consecutive patterns never give. Row j, group g: the amax 2^-g (1 + j/128) first, then 2^-g-1 (1 + i/128)
    for i = 1..127. Dividing by s (the rule) and multiplying by fp32(1 / s) give different codes for 32 of
    these values per layout, so the test tells the two apart."""
    sig = 1.0 + torch.arange(128) / 128.0
    ties = torch.stack([torch.cat([torch.cat([sig[j:j + 1], sig[1:] / 2]) * 2.0**-g for g in range(4)])
                        for j in range(128)]).to(dtype)
    pat = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    every = pat.view(torch.float16 if dtype == torch.float16 else torch.bfloat16).reshape(256, 256).to(dtype)
    edge = _edge(135, 300, torch.float32)[128:]  # rows 128..134: its tiny, saturating and tie rows
    edge[0, 3] = float("nan")
    edge[5, 200] = float("inf")
    edge[6] = 0.0
    edge = edge.to(dtype)
    strided = (torch.randn(256, 19, generator=torch.Generator().manual_seed(7)) * 5).to(dtype).t()
    return [("every pattern", every), ("ties", ties), ("edge", edge), ("strided", strided)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vllm_per_token_kernel_is_the_rollout_quantizer(dtype):
    """quantize_per_token: E4M3 data and scales [M, 1] equal ``rollout._token_fp8``; the read-back equals
    ``rollout._token_fake`` in float32 and its bf16 rounding, on every 16-bit pattern and the edge rows."""
    from nemo_fp8rl.fp8 import rollout as ro

    vq = kernels.vllm_ops()
    for name, x in _vllm_cases(dtype):
        q, s = vq.quantize_per_token(x)
        rq, rs = ro._token_fp8(x)
        assert _same(q, rq) and _same(s, rs), name
        fake = ro._token_fake(x)
        assert _same(vq.quantize_per_token(x, readback=True)[0], fake), name
        assert _same(vq.quantize_per_token(x, readback=True, out_dtype=torch.bfloat16)[0], fake.to(torch.bfloat16)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vllm_per_group_kernel_is_the_rollout_quantizer(dtype):
    """quantize_per_group (1x128): data and scales [M, K/128] equal ``rollout._group_fp8`` where K is a multiple
    of 128; the read-back equals ``rollout._group_fake`` at any K (a partial last group reads zeros)."""
    from nemo_fp8rl.fp8 import rollout as ro

    vq = kernels.vllm_ops()
    for name, x in _vllm_cases(dtype):
        if x.shape[1] % 128 == 0:
            q, s = vq.quantize_per_group(x, 128)
            rq, rs = ro._group_fp8(x, 128)
            assert _same(q, rq) and _same(s, rs), name
        else:
            assert vq.quantize_per_group(x, 128)[1].shape == (x.shape[0], -(-x.shape[1] // 128))
        fake = ro._group_fake(x, 128)
        assert _same(vq.quantize_per_group(x, 128, readback=True)[0], fake), name
        assert _same(vq.quantize_per_group(x, 128, readback=True, out_dtype=torch.bfloat16)[0],
                     fake.to(torch.bfloat16)), name


def test_rollout_schemes_run_the_kernels_where_they_run(monkeypatch):
    """With the kernels available (here: the interpreter), vllm_w8a8 and vllm_block quantize activations through
    them, in the FP8-GEMM layout and as read-back values of any leading shape, with the compiled/eager path's
    bits; with NEMO_FP8RL_KERNELS=0 they do not."""
    from nemo_fp8rl.fp8 import rollout as ro

    vq = kernels.vllm_ops()
    calls = []
    for fn in ("quantize_per_token", "quantize_per_group"):
        real = getattr(vq, fn)
        monkeypatch.setattr(vq, fn, lambda *a, _r=real, _n=fn, **kw: (calls.append(_n), _r(*a, **kw))[1])
    x = (torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    w8a8, block = ro.get_rollout_scheme("vllm_w8a8"), ro.get_rollout_scheme("vllm_block")
    got = [w8a8.activation_fp8(x.reshape(15, 256)), block.activation_fp8(x.reshape(15, 256)),
           w8a8.quantize_activation(x), block.quantize_activation(x)]
    assert calls == ["quantize_per_token", "quantize_per_group"] * 2
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "0")
    want = [w8a8.activation_fp8(x.reshape(15, 256)), block.activation_fp8(x.reshape(15, 256)),
            w8a8.quantize_activation(x), block.quantize_activation(x)]
    assert len(calls) == 4
    for g, w in zip(got[:2], want[:2]):
        assert _same(g.data, w.data) and _same(g.scale_inv, w.scale_inv) and g.granularity == w.granularity
    for g, w in zip(got[2:], want[2:]):
        assert g.shape == x.shape and _same(g, w)


# ------------------------------------------------------------------------------------------------------
# decode attention over the FP8 KV cache (kernels/kv_attention.py): within a derived float32 error bound
# ------------------------------------------------------------------------------------------------------

def _kv_codes(shape, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Random finite FP8 codes (every finite byte equally likely) of ``shape``."""
    finite = torch.tensor([c for c in range(256) if math.isfinite(
        torch.tensor([c], dtype=torch.uint8).view(get_format(fmt).dtype).float().item())], dtype=torch.uint8)
    return finite[torch.randint(0, finite.numel(), shape, generator=gen)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("H,G,hd", [(4, 1, 16), (2, 2, 80), (8, 2, 128)])
def test_decode_attention_is_within_its_float32_error_bound(fmt, H, G, hd):
    """kv_attention.decode_attention against the float64 attention over the read-back cache: every element
    within the bound of :func:`_decode_reference`, on ragged rows (1, 70 and 150 positions: one to three
    blocks), grouped and ungrouped heads, a head size that is not a power of two, scores spread over ~20
    nats; the stale positions past each row's length hold NaN codes, which must never be read."""
    g = torch.Generator().manual_seed(hd + H)
    B, S = 3, 160
    positions = torch.tensor([0, 69, 149])
    k_codes, v_codes = _kv_codes((B, G, S, hd), fmt, g), _kv_codes((B, G, S, hd), fmt, g)
    nan = 0x7F if fmt == "e4m3" else 0x7E
    for b in range(B):
        k_codes[b, :, int(positions[b]) + 1:] = nan
        v_codes[b, :, int(positions[b]) + 1:] = nan
    ks, vs = (0.013, 0.7) if fmt == "e4m3" else (2.0**-12, 0.0093)
    kmax = float(get_format(fmt).max) * ks
    q = torch.randn(B, H, hd, generator=g) * (6.0 / kmax)  # |scores| of a few to ~20
    kv = kernels.kv_ops()
    sm = 1.0 / math.sqrt(hd)
    got = kv.decode_attention(q, k_codes, v_codes, positions, ks, vs, fmt)
    want, bound = kernels.kv_ops().decode_reference(q, k_codes, v_codes, positions, ks, vs, fmt, sm)
    assert got.shape == (B, H, hd) and got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    err = (got.double() - want).abs().amax(-1)
    assert bool((err <= bound).all()), f"error {err.max():.3e} > bound {bound[err > bound].min():.3e}"
    # and the query in bf16 with strides (a view of [B, 1, H, hd]) reads the same as its float32 copy
    qb = q.to(torch.bfloat16).unsqueeze(1).transpose(1, 2)[:, :, 0]
    assert torch.equal(kv.decode_attention(qb, k_codes, v_codes, positions, ks, vs, fmt),
                       kv.decode_attention(qb.float().contiguous(), k_codes, v_codes, positions, ks, vs, fmt))


def test_decode_attention_refuses_shapes_it_cannot_run():
    kv = kernels.kv_ops()
    c = torch.zeros(1, 2, 8, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple"):
        kv.decode_attention(torch.zeros(1, 3, 16), c, c, torch.zeros(1, dtype=torch.long), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"q \[B, H, hd\]"):
        kv.decode_attention(torch.zeros(1, 4, 8), c, c, torch.zeros(1, dtype=torch.long), 1.0, 1.0)
    with pytest.raises(ValueError, match="e4m3 or e5m2"):
        kv.decode_attention(torch.zeros(1, 4, 16), c, c, torch.zeros(1, dtype=torch.long), 1.0, 1.0, fmt="fp8")


@pytest.mark.parametrize("fmt,kernel", [("e4m3", "cuda"), ("e5m2", "cpu")])
def test_torch_engine_decodes_through_the_kv_kernel_where_it_runs(fmt, kernel, monkeypatch):
    """The torch rollout engine's decode step attends through the kernel for every quantized layer (not the
    high-precision one), each call within the bound of the float64 attention over the same cache; with
    NEMO_FP8RL_KERNELS=0 it reads the cache back and runs SDPA (no kernel call)."""
    import importlib

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.fp8.kv_cache import KvScales
    from nemo_fp8rl.rollout import SamplingParams
    from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine
    from tests.rollout.conftest import random_hf_weights

    cfg = ModelConfig(name="kv", vocab_size=32, num_layers=3, hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, seq_length=80)
    scales = KvScales(torch.tensor([0.03, 0.05, 0.02]), torch.tensor([0.011, 0.013, 0.02]),
                      torch.tensor([0.007, 0.009, 0.03]))
    kvmod = importlib.import_module("nemo_fp8rl.fp8.kernels.kv_attention")
    real = kvmod.decode_attention
    calls = []

    def checked(q, k_codes, v_codes, positions, ks, vs, fmt_, sm_scale=None):
        o = real(q, k_codes, v_codes, positions, ks, vs, fmt_, sm_scale)
        want, bound = kernels.kv_ops().decode_reference(q.float(), k_codes, v_codes, positions, ks, vs, fmt_,
                                        1.0 / math.sqrt(q.shape[-1]))
        assert bool(((o.double() - want).abs().amax(-1) <= bound).all())
        calls.append((ks, vs))
        return o

    monkeypatch.setattr(kvmod, "decode_attention", checked)
    e = TorchRolloutEngine(cfg, fp8_scheme="off", eos_id=2, pad_id=0, kv_cache=fmt, kv_kernel=kernel,
                           high_precision_layers=(1,))
    e.update_weights(random_hf_weights(cfg, seed=0, logit_scale=4.0), kv_scales=scales)
    prompts = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13]]
    sp = SamplingParams(max_new_tokens=6, stop_on_eos=False)
    out = e.generate(prompts, sp, torch.Generator().manual_seed(0))
    steps = 5  # the first new token comes from the prefill
    assert calls == [scales.layer(0)[1:], scales.layer(2)[1:]] * steps
    assert out.tokens.shape[0] == 3
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "0")
    e.generate(prompts, sp, torch.Generator().manual_seed(0))
    assert len(calls) == 2 * steps


# ------------------------------------------------------------------------------------------------------
# the block-scaled FP8 GEMM that takes E5M2 (kernels/block_gemm.py): blockwise + hybrid's dgrad and wgrad
# ------------------------------------------------------------------------------------------------------


def _block_operands(seed: int, m: int, n: int, k: int, fmt_a: str, fmt_b: str, pow2: bool):
    """dgrad-like (A = dy [m, k] 1x128, B = W^T [n, k] tiles) and wgrad-like (A = dy^T, B = x^T, both 1x128 along
    the tokens) prepared operands, as the cast kernels write them, with their readable dequantized values."""
    from nemo_fp8rl.fp8.backends import QuantizedOperand

    o = kernels.ops()
    g = torch.Generator().manual_seed(seed)
    dy = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, k).pow(0.5)).to(torch.bfloat16)
    w = (torch.randn(k, n, generator=g) * 0.05).to(torch.bfloat16)  # W [out=k, in=n]: dgrad B = W^T [n, k]
    grow, gcol = o.cast_transpose_blockwise(dy, fmt_a, pow2=pow2, eps=0.0, row=True, col=True)
    _, wt = o.cast_weight_tiles(w, fmt_b, pow2=pow2, eps=0.0)
    x = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16)
    _, xcol = o.cast_transpose_blockwise(x, fmt_b, pow2=pow2, eps=0.0, row=False, col=True)
    dgrad = (QuantizedOperand(grow[0], grow[1], (1, 128), prepared=True, rows=m),
             QuantizedOperand(wt[0], wt[1], (128, 128), prepared=True))
    wgrad = (QuantizedOperand(gcol[0], gcol[1], (1, 128), prepared=True),
             QuantizedOperand(xcol[0], xcol[1], (1, 128), prepared=True))
    return dgrad, wgrad


@pytest.mark.parametrize("fmt_a,fmt_b,pow2", [("e5m2", "e4m3", True), ("e5m2", "e4m3", False),
                                              ("e4m3", "e4m3", True), ("e5m2", "e5m2", True)])
def test_block_scaled_gemm_is_within_its_error_bound(fmt_a, fmt_b, pow2):
    """block_scaled_mm on the cast kernels' prepared operands (dgrad: 1x128 x 128x128 tiles in torch's scale
    layout; wgrad: 1x128 x 1x128 along a padded token dimension; rows not a multiple of 4, K over several
    blocks) against the float64 product of the same FP8 values: every element within block_gemm_error_bound,
    in float32, bf16 and fp16; and the readable (unprepared) layouts give the same bits."""
    from nemo_fp8rl.fp8.backends import QuantizedOperand

    bg = kernels.block_gemm_ops()
    for a, b in _block_operands(11, 130, 256, 384, fmt_a, fmt_b, pow2):
        ah = _dequant_prepared(a)[: a.rows or a.data.shape[0]]
        bh = _dequant_prepared(b)
        exact = ah.double() @ bh.double().t()
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = bg.block_scaled_mm(a, b, out_dtype)
            assert got.shape == exact.shape and got.dtype == out_dtype
            bound = bg.block_gemm_error_bound(ah, bh, out_dtype)
            fin = torch.isfinite(got)
            if out_dtype != torch.float16:
                assert bool(fin.all())
            assert bool(((got.double() - exact).abs() <= bound)[fin].all()), (out_dtype, fmt_a, fmt_b)
        # the readable layouts: scales [rows, K/128] / [N/128, K/128] row-major, data as is
        kb = a.data.shape[1] // 128
        plain_a = QuantizedOperand(a.data, a.scale_inv[:, :kb].contiguous(), (1, 128), rows=a.rows)
        sb = b.scale_inv[:kb].t().contiguous() if b.granularity == (128, 128) else b.scale_inv.contiguous()
        plain_b = QuantizedOperand(b.data, sb, b.granularity)
        assert torch.equal(bg.block_scaled_mm(plain_a, plain_b), bg.block_scaled_mm(a, b))


def test_block_scaled_gemm_every_tiling_writes_the_same_bits_and_refuses_bad_input():
    from nemo_fp8rl.fp8.backends import QuantizedOperand

    bg = kernels.block_gemm_ops()
    (a, b), (aw, bw) = _block_operands(3, 70, 256, 256, "e5m2", "e4m3", True)
    for x, y in ((a, b), (aw, bw)):
        outs = [bg.block_scaled_mm(x, y, torch.bfloat16, _config=c) for c in bg.GEMM_CONFIGS]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    with pytest.raises(ValueError, match="multiple of 128"):
        bg.block_scaled_mm(QuantizedOperand(a.data[:, :100], a.scale_inv, (1, 128)),
                           QuantizedOperand(b.data[:, :100], b.scale_inv, (128, 128)))
    with pytest.raises(ValueError, match="granularity"):
        bg.block_scaled_mm(QuantizedOperand(a.data, a.scale_inv, "tensor"), b)
    with pytest.raises(ValueError, match="out_dtype"):
        bg.block_scaled_mm(a, b, torch.float64)


def test_block_scaled_gemm_bound_catches_a_wrong_scale():
    """The bound is tight enough to see one K block's scale read from the neighbouring block."""
    from nemo_fp8rl.fp8.backends import QuantizedOperand

    bg = kernels.block_gemm_ops()
    (a, b), _ = _block_operands(5, 64, 256, 384, "e5m2", "e4m3", False)
    ah, bh = _dequant_prepared(a)[: a.rows], _dequant_prepared(b)
    s = a.scale_inv.clone()
    s[:, [0, 1]] = s[:, [1, 0]]
    got = bg.block_scaled_mm(QuantizedOperand(a.data, s, (1, 128), prepared=True, rows=a.rows), b)
    bound = bg.block_gemm_error_bound(ah, bh)
    assert not bool(((got.double() - ah.double() @ bh.double().t()).abs() <= bound).all())


def test_hybrid_blockwise_runs_its_backward_on_the_fp8_block_gemm(monkeypatch):
    """NEMO_FP8RL_HYBRID_GEMM=fp8: blockwise + hybrid saves FP8 layouts (not bf16 copies) and runs dgrad and wgrad
    on block_scaled_mm (E5M2 dy x E4M3 W^T / x^T), within twice gemm_error_bound of the emulation, in the
    parameter's dtype; the forward stays on the (here: readable) E4M3 GEMM. =bf16 keeps the bf16 GEMMs."""
    from nemo_fp8rl.fp8 import backends, quantize_operand, torch_linear

    bg = kernels.block_gemm_ops()
    calls = []
    real_mm = bg.block_scaled_mm
    monkeypatch.setattr(bg, "block_scaled_mm", lambda a, b, *r, **kw: (calls.append((a.data.dtype, b.data.dtype)),
                                                                       real_mm(a, b, *r, **kw))[1])
    real_gemm = backends.scaled_gemm

    def gemm(a, b, out_dtype, fast_accum=False, bias=None):
        if torch.float8_e5m2 in (a.data.dtype, b.data.dtype):
            return real_gemm(a, b, out_dtype, fast_accum, bias)  # -> block_scaled_mm
        out = _dequant_prepared(a) @ _dequant_prepared(b).t()
        out = out[: a.rows] if a.rows is not None else out
        return (out if bias is None else out + bias.float()).to(out_dtype)

    monkeypatch.setattr(torch_linear, "scaled_gemm", gemm)
    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret")
    rec = get_recipe("blockwise", fp8_format="hybrid")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16).requires_grad_()
    x = (torch.randn(130, 384, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    got = {}
    for mode in ("fp8", "bf16"):
        monkeypatch.setenv("NEMO_FP8RL_HYBRID_GEMM", mode)
        y = torch_linear._Fp8KernelLinearFn.apply(x, w, None, rec, Fp8LinearState(rec), True)
        got[mode] = [y, *torch.autograd.grad(y, (x, w), dy)]
    assert calls == [(torch.float8_e5m2, torch.float8_e4m3fn)] * 2  # dgrad, wgrad; none under bf16
    st = Fp8LinearState(rec)
    hats = [(quantize_operand(x, "input", 1, rec, st, False), quantize_operand(w, "weight", 1, rec, st, False)),
            (quantize_operand(dy, "grad_output", 1, rec, st, False), quantize_operand(w, "weight", 0, rec, st, False).t()),
            (quantize_operand(dy, "grad_output", 0, rec, st, False).t(), quantize_operand(x, "input", 0, rec, st, False).t())]
    for i, ((a, b), out, ref) in enumerate(zip(hats, got["fp8"], got["bf16"])):
        assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
        bound = backends.gemm_error_bound(a, b, torch.bfloat16) + kernels.block_gemm_ops().block_gemm_error_bound(
            a, b, torch.bfloat16)
        assert bool(((out.double() - ref.double()).abs() <= bound).all()), f"output {i}"
    monkeypatch.setenv("NEMO_FP8RL_HYBRID_GEMM", "sometimes")
    with pytest.raises(ValueError, match="NEMO_FP8RL_HYBRID_GEMM"):
        torch_linear._Fp8KernelLinearFn.apply(x, w, None, rec, Fp8LinearState(rec), True)


# ------------------------------------------------------------------------------------------------------
# delayed scaling's update in one launch (cast_transpose.delayed_update)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fmt,pow2,margin,eps,hist_len", [("e4m3", False, 0, 0.0, 16), ("e4m3", True, 2, 0.0, 1),
                                                          ("e5m2", False, 1, 1e-12, 5), ("e5m2", True, 0, 0.0, 1024)])
def test_delayed_update_kernel_is_the_meta_update(monkeypatch, algo, fmt, pow2, margin, eps, hist_len):
    """DelayedScalingMeta.record_and_update through the kernel (one launch) and through torch's ops: the same
    history and scale bits after every one of 40 updates with amaxes that are ordinary, 0, tiny (an infinite
    scale, capped), huge, inf and NaN (a NaN stays in the history: max is NaN until it rolls out)."""
    from nemo_fp8rl.fp8.state import DelayedScalingMeta

    rec = get_recipe("delayed", fp8_format="e5m2" if fmt == "e5m2" else "e4m3", amax_compute_algo=algo,
                     margin=margin, pow2_scales=pow2, amax_epsilon=eps, amax_history_len=hist_len)
    g = torch.Generator().manual_seed(hist_len)
    amaxes = list((torch.rand(40, generator=g) * 10.0 ** torch.randint(-6, 6, (40,), generator=g)).tolist())
    for i, v in zip((3, 7, 11, 15, 19, 23), (0.0, 1e-45, 3e38, float("inf"), float("nan"), 2.0**-130)):
        amaxes[i] = v
    metas = {mode: DelayedScalingMeta(hist_len) for mode in ("interpret", "0")}
    calls = []
    real = kernels.ops().delayed_update
    monkeypatch.setattr(kernels.ops(), "delayed_update", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    for step, a in enumerate(amaxes):
        for mode, meta in metas.items():
            monkeypatch.setenv("NEMO_FP8RL_KERNELS", mode)
            meta.record_and_update(torch.tensor(a, dtype=torch.float32), rec, "input")
        k, t = metas["interpret"], metas["0"]
        assert _same(k.amax_history, t.amax_history) and _same(k.scale, t.scale), (step, a)
        assert k.scale.shape == () and k.amax_history.shape == (hist_len,)
    assert len(calls) == len(amaxes)


def test_delayed_linear_adds_no_torch_ops_to_tensorwise(monkeypatch):
    """On the kernel path a delayed linear's forward + backward runs the same torch ops as tensorwise's, apart from
    Triton's interpreter's own (buffers and copies): its scale bookkeeping is the one launch per operand above,
    not ~25 small ops each (issue 38: delayed's host overhead, 46 launches per linear on the H200)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    # allocations, views and the interpreter's copies of kernel arguments: no compute kernel on a GPU
    noise = {"set_", "empty", "empty_like", "new_empty", "copy_", "view", "detach", "empty_strided", "lift_fresh",
             "alias"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).split(".")[-1]
            if name not in noise:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setenv("NEMO_FP8RL_KERNELS", "interpret")
    counts = {}
    for name in ("tensorwise", "delayed"):
        rec = get_recipe(name)
        w = (torch.randn(128, 64) * 0.05).to(torch.bfloat16).requires_grad_()
        st = Fp8LinearState(rec)
        x = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
        for _ in range(2):  # the second step: delayed scales from a history
            c = Count()
            with c:
                y = fp8_linear(x, w, None, rec, st, backend="torch")
                y.backward(torch.ones_like(y))
        counts[name] = c.ops
    assert counts["delayed"] == counts["tensorwise"], counts
