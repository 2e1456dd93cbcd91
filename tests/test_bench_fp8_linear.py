"""Smoke test of ``benchmarks/bench_fp8_linear.py``: ``--quick`` at tiny shapes with the eager quantizer only
(nothing compiles), and its byte counter on a case computed by hand. No timing assertions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.fp8 import fused, quantize
from nemo_fp8rl.fp8.quantize import fake_quantize

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_fp8_linear.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_fp8_linear", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_quick_eager_prints_every_table(bench, capsys, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("--compile false must not compile")

    monkeypatch.setattr(torch, "compile", no_compile)
    threads = torch.get_num_threads()
    bench.main(["--quick", "--compile", "false", "--repeats", "1"])
    out = capsys.readouterr().out
    assert torch.get_num_threads() == threads
    assert "Quantizer, FP8 data" in out and "Quantizer, read-back" in out and "Target (issue 26)" in out
    assert "Forward+backward of one linear" in out and "nn.Linear" in out
    for recipe in bench.RECIPES:
        assert f"ours/{recipe} eager" in out
    # eager tensorwise FP8 data of the [64, 128] input: 33 B per element plus the 0-d scale rule
    row = next(line for line in out.splitlines() if line.startswith("input/K 64x128") and "tensorwise" in line)
    assert float(row.split()[6]) == pytest.approx(33.0, abs=0.05)


def test_parse_layers_rejects_the_old_mxkxn_form(bench):
    assert bench.parse_layers("q/o=4096x4096,4096x1024") == [("q/o", 4096, 4096), ("layer1", 4096, 1024)]
    with pytest.raises(SystemExit, match="--linear-shapes"):
        bench.parse_layers("2048x512x512")


def test_default_shapes_are_qwen3_8b(bench):
    layers = bench.parse_layers(bench.qwen3_8b_layers())
    assert [(k, n) for _, k, n in layers] == [(4096, 4096), (4096, 4096), (4096, 1024), (4096, 24576), (12288, 4096)]
    ops = bench.operands(layers, 4096)
    assert len(ops) == 12  # 2 inputs, 4 weights, 3 gradient shapes x 2 dims (shared operands counted once)


def test_views_are_free_and_strided_tensors_count_their_elements(bench):
    x = torch.randn(48, 80)
    with bench.ByteCounter() as c:
        y = x.t()[:, :40].unsqueeze(0)  # views: free
        y.abs()  # a strided [1, 80, 40] read: numel * 4, written contiguous: numel * 4
    assert c.records == [("aten.abs.default", 8 * 80 * 40)]


def test_byte_counter_eager_tensorwise_quantize(bench):
    """Eager ``quantize(x, "e4m3", "tensor")`` of a float32 [M, K] x, op by op (quantize.py):

        |x|                 abs        read 4, write 4      per element
        amax(|x|)           amax       read 4, write one float32
        x * s               mul        read 4 and the 0-d s, write 4
        clamp(-448, 448)    clamp      read 4, write 4
        .to(float8_e4m3fn)  _to_copy   read 4, write 1
                                       = 33 bytes per element

    (``x.float()`` of a float32 tensor dispatches nothing.) Everything else is the scale rule and the
    non-finite count on 0-d tensors, the same ops whatever the size.
    """
    def count(m, k):
        x = torch.randn(m, k)
        with fused.compile_mode_set("false"), bench.ByteCounter() as c:
            quantize(x, "e4m3", "tensor")
        return c, x.numel()

    (c1, n1), (c2, n2) = count(64, 96), count(128, 160)
    big = [r for r in c2.records if r[1] >= n2]
    assert big == [("aten.abs.default", 8 * n2), ("aten.amax.default", 4 * n2 + 4), ("aten.mul.Tensor", 8 * n2 + 4),
                   ("aten.clamp.default", 8 * n2), ("aten._to_copy.default", 5 * n2)]
    scalar = [r for r in c2.records if r[1] < n2]
    assert all(b <= 4 * 8 for _, b in scalar)  # at most 3 arguments and one result of 0-d tensors
    assert c2.total == 33 * n2 + 8 + sum(b for _, b in scalar)
    assert c2.total - c1.total == 33 * (n2 - n1)


@pytest.mark.parametrize("gran,dim", [((1, 128), 0), ("mx", 1), ((128, 128), 1)])
def test_fused_block_read_back_moves_one_read_and_one_write(bench, gran, dim):
    """Inductor's own byte count for the compiled float32 read-back (``fake_quantize``) of 1-D block, MX and
    2-D tile groups: one read of x for the amax, one read and one float32 write for the cast and read-back,
    12 B per element, plus the per-group scales. A padded grouped read-back materialised and copied back to
    x's layout costs 8 B more (20.1-20.5 B/el before the fix, docs/results.md). Bytes, not time: they depend
    only on the generated code."""
    from torch._inductor import config as inductor_config

    x = torch.randn(384, 520)  # 520: not a multiple of any block, so the pad is in play
    counter, keys = bench.FusedGraphBytes(), []
    fused.reset()
    with inductor_config.patch(fx_graph_cache=False), fused.compile_mode_set("true"), \
            bench._inductor_byte_count(), counter.watch(keys):
        out = fake_quantize(x, "e4m3", gran, dim=dim, pow2_scales=True, out_dtype=torch.float32)
    with fused.compile_mode_set("false"):
        ref = fake_quantize(x, "e4m3", gran, dim=dim, pow2_scales=True, out_dtype=torch.float32)
    if fused.compile_unavailable():
        pytest.skip(f"torch.compile is unavailable here: {fused.compile_unavailable()}")
    assert torch.equal(out, ref)
    per_element = counter.per_element(keys)
    assert per_element is not None and 12.0 <= per_element <= 13.0, per_element
