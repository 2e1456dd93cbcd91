"""Child process of test_streamed_export.py: peak extra RSS of exporting a model with N layers.

Prints one JSON line: the peak RSS above the level before the export (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``), for the streamed export (tensors consumed and dropped one by one)
and for ``export_weights()`` (the whole model kept), and the bytes of one transformer layer.
"""

import gc
import json
import sys
import warnings


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS


def main(layers: int) -> None:
    warnings.filterwarnings("ignore")
    import torch

    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.hf_weights import hf_layer_names, hf_shape

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, num_layers=layers, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024)
    actor = build_actor(cfg, ParallelConfig(), seed=0, lr=1e-4, device="cpu", distributed_optimizer=False)
    layer_bytes = 4 * sum(torch.Size(hf_shape(cfg, n)).numel() for n in hf_layer_names(cfg, 0))
    out = {"layers": layers, "layer_bytes": layer_bytes}
    for mode in ("stream", "dict"):
        gc.collect()
        _reset_hwm()
        base = _hwm_kb()
        if mode == "stream":
            numel = 0
            for _, t in actor.iter_weights():
                numel += t.numel()
                del t
        else:
            sd = actor.export_weights()
            numel = sum(t.numel() for t in sd.values())
        out[f"{mode}_extra_bytes"] = (_hwm_kb() - base) * 1024
        out[f"{mode}_numel"] = numel
        sd = None
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]))
