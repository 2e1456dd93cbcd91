"""Streamed weight export: ``FP8Actor.iter_weights()`` holds about one tensor at a time.

Peak extra RSS of the export, measured in a fresh process per model (``VmHWM`` reset through
``/proc/self/clear_refs`` right before it), for 2 and 8 layers of ~1M parameters each: the streamed
export's peak does not grow with the number of layers and stays about one layer's bytes, while
``export_weights()`` (which keeps the whole model) grows by about a layer per layer - the measurement
sees growth when there is some. The streamed tensors equal ``export_weights()`` (the TP/PP layouts of
``export_weights`` are tested in test_parallel.py, through this same stream).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_REPO = Path(__file__).resolve().parents[2]


def _measure(layers: int) -> dict:
    # A fixed mmap threshold: glibc then maps every buffer >= 64 KiB on its own and unmaps it when freed,
    # so RSS follows the live tensors (with glibc's default, memory freed while building the model stays
    # resident and hides what the export allocates).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_rss_export.py")), str(layers)],
                          capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and "clear_refs" in proc.stderr:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs): {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_streamed_export_peak_memory_does_not_grow_with_layers():
    small, big = _measure(2), _measure(8)
    layer = big["layer_bytes"]
    assert small["stream_numel"] == small["dict_numel"] and big["stream_numel"] == big["dict_numel"]
    # whole model kept: grows by about one layer per layer (the measurement can see growth)
    assert big["dict_extra_bytes"] - small["dict_extra_bytes"] > 4 * layer, (small, big)
    # streamed: no growth beyond noise, and less than one layer in all (measured 0.7 layer for both)
    assert big["stream_extra_bytes"] - small["stream_extra_bytes"] < 0.25 * layer, (small, big)
    assert big["stream_extra_bytes"] < layer, (small, big)


def test_stream_equals_export_weights():
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor

    actor = build_actor(ModelConfig(vocab_size=19, qk_layernorm=True, untie_embeddings_and_output_weights=False),
                        ParallelConfig(), seed=0, lr=1e-4, device="cpu")
    streamed = dict(actor.iter_weights())
    full = actor.export_weights()
    assert streamed.keys() == full.keys()
    assert all(torch.equal(streamed[k], full[k]) for k in full)


def test_hf_checkpoint_from_the_stream_equals_the_one_from_the_dict(tmp_path):
    """save_hf_checkpoint writes each shard as soon as the stream delivered it; the files are the ones
    save_hf_state_dict writes from the whole state dict, byte for byte (several shards)."""
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.hf_save import save_hf_checkpoint, save_hf_state_dict

    actor = build_actor(ModelConfig(vocab_size=19), ParallelConfig(), seed=0, lr=1e-4, device="cpu")
    a = save_hf_checkpoint(actor, tmp_path / "stream", max_shard_bytes=200_000)
    b = save_hf_state_dict(actor.export_weights(), actor.model_cfg, tmp_path / "dict", max_shard_bytes=200_000)
    files = sorted(p.name for p in a.iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) > 2
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    with pytest.raises(KeyError, match="lacked"):
        save_hf_state_dict(((n, t) for n, t in actor.iter_weights() if "layers.1." not in n), actor.model_cfg,
                           tmp_path / "short")
    assert not (tmp_path / "short").exists() and not list(tmp_path.glob(".short*"))
