"""One audit, top to bottom: inputs -> high-precision samples -> scores per configuration -> statistics ->
layer ranking -> recommendation -> report (docs/audit.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from nemo_fp8rl.audit.configs import AuditConfiguration, parse_configs
from nemo_fp8rl.audit.settings import check_audit_config
from nemo_fp8rl.config.schema import ConfigError

__all__ = ["run_audit"]

log = logging.getLogger("nemo_fp8rl.audit")


@contextlib.contextmanager
def _timed(timings: dict, key: str):
    """The trainer's phase timer (waits for the GPU at both ends: nemo_fp8rl/trainer/timing.py), logged and
    rounded to 10 ms for the report."""
    from nemo_fp8rl.trainer import timing

    log.info("audit: %s ...", key)
    spent: dict[str, float] = {}
    with timing.timed(spent, key):
        yield
    timings[key] = round(spent[key], 2)
    log.info("audit: %s done in %.1f s", key, timings[key])



def audit_sampling_params(cfg: Any) -> Any:
    """How the audit samples its high-precision responses: the run's temperature and top-p, at most
    ``audit.response_len`` tokens; ``audit.eos``: ``ignore`` samples past the end-of-turn token, ``suppress``
    and ``stop`` stop at it (``suppress`` not before the length: :func:`sample_responses`'s min tokens), and
    ``stop`` also at the run's ``rollout.stop`` strings, so its response lengths are training's."""
    from nemo_fp8rl.rollout import SamplingParams

    a = cfg.audit
    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          max_new_tokens=a.response_len, stop_on_eos=a.eos != "ignore",
                          stop=tuple(cfg.rollout.stop) if a.eos == "stop" else ())

def _load_inputs(cfg: Any) -> tuple[Any, Any, Any, list[list[int]]]:
    """(model_cfg, tokenizer, HF-named weights, prompt ids) as the trainer would see them."""
    from nemo_fp8rl.audit.prompts import load_task, prompts_from_file, prompts_from_task
    from nemo_fp8rl.models.hf_config import resolve_model_config

    a = cfg.audit
    model_cfg = resolve_model_config(cfg.model)
    if a.prompts_file and model_cfg.hf_path:
        from nemo_fp8rl.tasks.hf_tokenizer import HFTokenizer

        tok = HFTokenizer.from_pretrained(model_cfg.hf_path)
        prompts = prompts_from_file(a.prompts_file, tok, a.prompts, key=a.prompt_key, chat_template=a.chat_template)
    else:
        task = load_task(cfg)
        tok = task.tokenizer
        prompts = (prompts_from_file(a.prompts_file, tok, a.prompts, key=a.prompt_key, chat_template=a.chat_template)
                   if a.prompts_file else prompts_from_task(task, a.prompts, cfg.seed * 1000 + 977))
        task.close()
    longest = max(len(p) for p in prompts)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=model_cfg.vocab_size or tok.vocab_size,
                                    seq_length=max(model_cfg.seq_length, longest + a.response_len))
    if model_cfg.hf_path:
        from nemo_fp8rl.models.hf_load import load_hf_state_dict

        weights = load_hf_state_dict(model_cfg.hf_path, model_cfg)
    else:
        from nemo_fp8rl.models.hf_weights import init_hf_state_dict

        log.warning("audit: model.hf_path is not set: auditing the seeded random initial weights of model=%s "
                    "(give model.hf_path or a registry model for a trained one)", model_cfg.name)
        weights = init_hf_state_dict(model_cfg, cfg.seed)
    return model_cfg, tok, weights, prompts


def _device(cfg: Any) -> tuple[torch.device, torch.dtype, str]:
    """GPU: bfloat16 engines with torch's FP8 GEMMs where they run the scheme (``fp8.backend=emulate`` keeps
    them emulated); CPU: float32, emulated."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16, "emulate" if cfg.fp8.backend == "emulate" else "torch"
    return torch.device("cpu"), torch.float32, "emulate"


def _describe_scales(scales: Any, fmt: str, margin: float) -> str:
    """One line: the range over layers of the calibrated q/k/v scales and of the amax each maps to the format's
    largest value (amax = scale x max / margin; the static scale 1.0 maps 448 for E4M3)."""
    m = 448.0 if fmt == "e4m3" else 57344.0
    parts = []
    for n in ("q", "k", "v"):
        t = getattr(scales, n)
        lo, hi = float(t.min()), float(t.max())
        parts.append(f"{n} {lo:.3g}-{hi:.3g} (amax {lo * m / margin:.3g}-{hi * m / margin:.3g})")
    return f"calibrated {fmt} KV scales over layers: " + ", ".join(parts)


def engine_factory(cfg: Any, model_cfg: Any, weights: Any, tok: Any, device: torch.device, dtype: torch.dtype,
                   gemm: str) -> Any:
    """The audit's :class:`~nemo_fp8rl.audit.scoring.EngineFactory`: the tokenizer's end ids (where a response
    ends, or what ``audit.eos=suppress`` keeps from being sampled) and padding id, the training recipe
    for ``same_as_train``."""
    from nemo_fp8rl.audit.scoring import EngineFactory
    from nemo_fp8rl.fp8.recipes import build_fp8_recipe

    return EngineFactory(model_cfg, weights, device, dtype, gemm, build_fp8_recipe(cfg), eos_id=tok.eos_id,
                         eos_ids=getattr(tok, "eos_ids", None), pad_id=tok.pad_id)


def _rank_target(configs: list[AuditConfiguration], name: Any) -> AuditConfiguration | None:
    roll = [c for c in configs if c.side == "rollout"]
    if name is not None:
        for c in configs:
            if c.name == name:
                if c.side != "rollout":
                    raise ConfigError(f"audit.rank_config={name!r} is a training configuration; layers are ranked "
                                      "in the rollout engine: name a rollout configuration of audit.configs")
                return c
        raise ConfigError(f"audit.rank_config={name!r} is not in audit.configs {[c.name for c in configs]}; name one "
                          "of them or null")
    plain = [c for c in roll if not any(c.edge)] or roll
    if not plain:
        return None
    most = max(c.fp8_amount() for c in plain)  # the fullest FP8 rollout without edge layers; the last of ties
    return [c for c in plain if c.fp8_amount() == most][-1]


def _rank_layers(engine: Any, hp_engine: Any, tokens: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor,
                 prompt_lens: torch.Tensor, logp_hp: torch.Tensor, layers: list[int], a: Any, temp: float,
                 name: str) -> dict:
    """Mean |dlogp| of ``engine`` with each of ``layers`` alone in high precision, on the first
    ``audit.rank_sequences`` sequences cut to ``audit.rank_response_len`` response tokens."""
    from nemo_fp8rl.audit import stats
    from nemo_fp8rl.audit.scoring import LayerSwapper, score_engine

    n = min(a.rank_sequences, tokens.shape[0])
    sub_len = torch.minimum(lengths[:n], prompt_lens[:n] + a.rank_response_len)
    width = int(sub_len.max())
    sub_tokens = tokens[:n, :width]
    sub_mask = mask[:n, :width] & (torch.arange(width).unsqueeze(0) < sub_len.unsqueeze(1))
    ref = logp_hp[:n, :width].double()

    def mad(eng: Any) -> float:
        lp = score_engine(eng, sub_tokens, sub_len, temperature=temp, batch=a.score_batch)
        return float((lp.double() - ref)[sub_mask].abs().mean())

    base = mad(engine)
    swapper = LayerSwapper(engine, hp_engine)
    per_layer = {}
    for i in layers:
        with swapper.swap(i) as eng:
            per_layer[i] = mad(eng)
    return {"config": name, "sequences": n, "tokens": int(sub_mask.sum()), "base_mean_abs_dlogp": base,
            "layers": stats.layer_ranking(base, per_layer)}


def run_audit(cfg: Any, command: str = "") -> dict:
    """Run the audit of ``cfg`` (an :class:`~nemo_fp8rl.audit.settings.AuditRunConfig`, validated) and write
    its report; returns the report's dict (what ``audit.json`` holds)."""
    from nemo_fp8rl.audit import stats
    from nemo_fp8rl.audit.recommend import recommend
    from nemo_fp8rl.audit.report import write_report
    from nemo_fp8rl.audit.sampling import sample_responses
    from nemo_fp8rl.audit.scoring import calibrated_kv_scales, score_engine, score_train_recipe
    from nemo_fp8rl.fp8 import fused
    from nemo_fp8rl.fp8.recipes import resolve_auto_recipe

    a = check_audit_config(cfg.audit)
    out_dir = Path(a.out or Path(cfg.output_dir) / "audit")
    timings: dict[str, float] = {}
    t_start = time.perf_counter()  # the whole audit: its phases below wait for the GPU (_timed)
    device, dtype, gemm = _device(cfg)
    if device.type == "cpu" and cfg.trainer.cpu_threads:
        torch.set_num_threads(cfg.trainer.cpu_threads)
    resolve_auto_recipe(cfg, device)
    compile_mode = str(cfg.fp8.compile).lower()
    if device.type == "cpu" and compile_mode == "auto":
        # two forwards per training recipe: Inductor's C++ compile would cost more than it saves (bit-equal)
        compile_mode = "false"
    fused.set_compile_mode(compile_mode)

    from nemo_fp8rl.models.hf_config import resolve_model_config

    # bad names and layers stop before any model work
    L = resolve_model_config(cfg.model).num_layers
    configs = parse_configs(cfg, L)
    rank_cfg = _rank_target(configs, a.rank_config)
    rank_layers = list(range(L)) if a.rank_layers is None else sorted(set(a.rank_layers))
    bad = [i for i in rank_layers if i >= L]
    if bad:
        raise ConfigError(f"audit.rank_layers {bad} are not layers of the model (0..{L - 1}); give indices below "
                          f"{L}, null for all, [] for no ranking")
    with _timed(timings, "load"):
        model_cfg, tok, weights, prompts = _load_inputs(cfg)
    factory = engine_factory(cfg, model_cfg, weights, tok, device, dtype, gemm)
    eps_low, eps_high = cfg.algorithm.eps_low, cfg.algorithm.eps_high

    # 1. responses sampled at high precision; every configuration scores these tokens
    G = a.samples_per_prompt
    expanded = [p for p in prompts for _ in range(G)]
    min_new = a.response_len if a.eos == "suppress" else 0
    params = audit_sampling_params(cfg)
    with _timed(timings, "sample"):
        hp_engine = factory.high_precision()
        batch = sample_responses(hp_engine, expanded, params, torch.Generator().manual_seed(cfg.seed * 1000 + 983),
                                 min_new_tokens=min_new)
    tokens, mask = batch.tokens, batch.mask.bool()
    lengths = batch.prompt_lens + batch.response_lens
    T = tokens.shape[1]
    response_pos = torch.arange(T).unsqueeze(0) - batch.prompt_lens.unsqueeze(1)
    temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0

    with _timed(timings, "score_high_precision"):
        logp_hp = score_engine(hp_engine, tokens, lengths, temperature=temp, batch=a.score_batch)

    # 2. each configuration on the same tokens: the rollout ones (and the layer ranking, while the
    #    high-precision engine is up), then the training recipes, whose models need the memory the engines held
    kv_scales = None
    logps: dict[str, torch.Tensor] = {}
    refs: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    ranking: dict[str, Any] = {"config": None, "layers": []}
    for c in (c for c in configs if c.side == "rollout"):
        with _timed(timings, f"score {c.name}"):
            setup = c.setup(L, cfg.rollout.fp8)
            scales = None
            if c.calibrated:
                if kv_scales is None or kv_scales[0] != c.kv_cache:
                    kv_scales = (c.kv_cache, calibrated_kv_scales(model_cfg, weights, tokens, lengths, setup, device,
                                                                  rows=range(0, tokens.shape[0], G)))
                    notes.append(_describe_scales(kv_scales[1], c.kv_cache, setup.kv_calib_margin))
                scales = kv_scales[1]
            eng = factory.for_setup(setup, c.kv_kernel, scales)
            logps[c.name] = score_engine(eng, tokens, lengths, temperature=temp, batch=a.score_batch)
            refs[c.name] = logp_hp
        if rank_cfg is not None and c.name == rank_cfg.name and rank_layers:
            # 3. which layers contribute most (one layer at a time in high precision)
            with _timed(timings, "rank_layers"):
                ranking = _rank_layers(eng, hp_engine, tokens, lengths, mask, batch.prompt_lens, logp_hp, rank_layers,
                                       a, temp, rank_cfg.name)
        eng.close()
    hp_engine.close()
    shadow = None
    for c in (c for c in configs if c.side == "train"):
        with _timed(timings, f"score {c.name}"):
            lp, sh = score_train_recipe(cfg, model_cfg, weights, tokens, c.recipe, c.recipe_overrides, temperature=temp)
            logps[c.name], refs[c.name] = lp, sh
            shadow = sh
    if shadow is not None:
        from nemo_fp8rl.models import destroy_distributed

        destroy_distributed()
        floor = stats.config_stats(shadow, logp_hp, mask, side="train", eps_low=eps_low, eps_high=eps_high,
                                   response_pos=response_pos, position_buckets=a.position_buckets)
        notes.append("trainer's model with FP8 off vs the rollout engine in high precision (implementation floor): "
                     f"mean |dlogp| {floor['mean_abs_dlogp']:.2e}, pure-noise clips {floor['noise_clip']:.4f}")

    # 4. statistics
    results = []
    for c in configs:
        r = stats.config_stats(logps[c.name], refs[c.name], mask, side=c.side, eps_low=eps_low, eps_high=eps_high,
                               response_pos=response_pos, position_buckets=a.position_buckets)
        d = logps[c.name].double() - refs[c.name].double()
        r["calibration"] = stats.calibration_bounds(
            -d if c.side == "rollout" else d, mask, eps_low=eps_low, eps_high=eps_high, alphas=a.calib_alphas,
            lower_min=cfg.calibration.lower_min, upper_max=cfg.calibration.upper_max)
        results.append(r)

    def pair(train_name: str, rollout_name: str) -> dict:
        """The trainer's ratio with old_logprobs=rollout and no policy change, exp(logp_train - logp_rollout),
        with each side's implementation floor removed: d = (train - its shadow) - (rollout - high precision)."""
        d = (logps[train_name] - refs[train_name]) - (logps[rollout_name] - logp_hp)
        r = stats.config_stats(logp_hp + d, logp_hp, mask, side="train", eps_low=eps_low, eps_high=eps_high,
                               response_pos=response_pos, position_buckets=a.position_buckets)
        r["calibration"] = stats.calibration_bounds(d, mask, eps_low=eps_low, eps_high=eps_high, alphas=a.calib_alphas,
                                                    lower_min=cfg.calibration.lower_min,
                                                    upper_max=cfg.calibration.upper_max)
        return {"train": train_name, "rollout": rollout_name, **r}

    rec = recommend(results, configs, max_extra_clip=a.max_extra_clip, calibrate_above=a.calibrate_above,
                    fp8_recipe=cfg.fp8.recipe, pair=pair)
    timings["total"] = round(time.perf_counter() - t_start, 2)
    report = {
        "command": command,
        "model": {"name": model_cfg.name, "hf_path": model_cfg.hf_path, "num_layers": L},
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "fp8_gemm": gemm,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "eps_low": eps_low, "eps_high": eps_high, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
        "sequences": int(tokens.shape[0]), "prompts": len(prompts), "samples_per_prompt": G,
        "response_len": a.response_len, "eos": a.eos,
        "response_tokens": int(mask.sum()), "mean_response_len": float(batch.response_lens.float().mean()),
        "prompt_len_mean": float(batch.prompt_lens.float().mean()),
        "position_buckets": list(a.position_buckets),
        "configs": [{"name": c.name, "side": c.side, "describe": c.describe(), "overrides": c.overrides(), **r}
                    for c, r in zip(configs, results)],
        "layer_ranking": ranking,
        "recommendation": rec,
        "notes": notes,
        "timings_s": timings,
        "eos_ids": list(factory.eos_ids or [factory.eos_id]),
        "first_prompt": tok.decode(tokens[0, : int(batch.prompt_lens[0])].tolist()),
        "first_response": tok.decode(tokens[0, int(batch.prompt_lens[0]): int(lengths[0])].tolist())[:3000],
    }
    write_report(report, out_dir)
    report["out_dir"] = str(out_dir)
    return report
