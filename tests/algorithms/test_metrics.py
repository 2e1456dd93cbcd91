import pytest
import torch

from nemo_fp8rl.algorithms.metrics import make_metric, metrics_to_floats, reduce_metrics


def test_local_reduction_by_kind():
    d1 = {"m": make_metric(1.0, "mean"), "s": make_metric(2.0, "sum"), "lo": make_metric(4.0, "min")}
    d2 = {
        "m": make_metric(3.0, "mean"),
        "s": make_metric(5.0, "sum"),
        "lo": make_metric(-1.0, "min"),
        "hi": make_metric(torch.tensor([7.0]), "max"),
    }
    out = metrics_to_floats(reduce_metrics([d1, d2]))
    assert out == {"m": 2.0, "s": 7.0, "lo": -1.0, "hi": 7.0}
    red = reduce_metrics([d1, d2])
    assert red["m"][1] == "mean" and red["hi"][1] == "max" and red["m"][0].dim() == 0


def test_bad_metrics_raise():
    with pytest.raises(ValueError, match="reduction"):
        make_metric(1.0, "median")
    with pytest.raises(ValueError, match="one element"):
        make_metric(torch.ones(3), "mean")
    with pytest.raises(ValueError, match="reduction"):
        reduce_metrics([{"a": (torch.tensor(1.0), "mean")}, {"a": (torch.tensor(1.0), "sum")}])
    with pytest.raises(ValueError, match="tuple"):
        reduce_metrics([{"a": 1.0}])
    with pytest.raises(ValueError, match="not initialised"):
        reduce_metrics([{"a": make_metric(1.0, "mean")}], group=object())


def test_metrics_to_floats_mixed_inputs_keep_order():
    out = metrics_to_floats({"b": make_metric(2.5, "mean"), "a": 1, "c": torch.tensor(3.0)})
    assert list(out) == ["b", "a", "c"] and out == {"b": 2.5, "a": 1.0, "c": 3.0}


def test_all_reduce_over_two_gloo_ranks_one_collective_per_kind(gloo_results):
    results = [r["reduce"] for r in gloo_results]
    # rank0 loss mbs 0,1 -> 0.5 ; rank1 -> 1.5 ; mean 1.0
    expected = {"loss": 1.0, "tok": 10.0 * 2 + 20.0 * 2, "kl": 0.25, "rmin": -1.0, "rmax": 3.0}
    for out, ncalls in results:
        assert out == pytest.approx(expected)
        assert ncalls == 4  # mean, sum, min, max: one collective each
