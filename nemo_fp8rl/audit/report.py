"""The audit's report: ``audit.json`` (everything), ``audit.md`` (tables and the recommendation) and
``audit.png`` (mismatch and pure-noise clips against response position and token probability, layer ranking)."""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["markdown", "write_report"]


def _f(x, fmt: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _rows(rep: dict) -> list[dict]:
    """The configurations, then the recommended pair's trainer ratio (when a training recipe was audited)."""
    p = rep["recommendation"].get("pair")
    extra = [{**p, "name": f"pair: {p['train']} + {p['rollout']}",
              "describe": "the trainer's ratio exp(logp_train - logp_rollout) with old_logprobs=rollout"}] if p else []
    return list(rep["configs"]) + extra


def markdown(rep: dict) -> str:
    """The markdown of ``audit.md`` from the report dict."""
    L0, H0 = 1 - rep["eps_low"], 1 + rep["eps_high"]
    rows = _rows(rep)
    alphas = sorted({k for c in rows for k in c["calibration"]["lower_at_alpha"]}, key=float)
    lines = [
        f"# FP8 audit: {rep['model']['name']}", "",
        f"`{rep['command']}`" if rep.get("command") else "", "",
        f"{rep['sequences']} sequences ({rep['prompts']} prompts x {rep['samples_per_prompt']}), "
        f"{rep['response_tokens']} response tokens (mean response {rep['mean_response_len']:.0f} tokens, "
        f"audit.eos={rep['eos']}), sampled at high precision "
        f"(temperature {rep['temperature']}, top-p {rep['top_p']}); {rep['device']} {rep['dtype']}, FP8 GEMMs "
        f"{rep['fp8_gemm']}; clip range [{L0:g}, {H0:g}]. Total {rep['timings_s']['total']:.0f} s.", "",
        "## Mismatch against high precision and pure-noise clips", "",
        "| configuration | what | mean abs dlogp | KL (k3) | token_mult_prob_error | pure-noise clips | "
        f"below {L0:g} | above {H0:g} | calib. lower on-policy | "
        + " | ".join(f"calib. lower at alpha {a}" for a in alphas) + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(alphas),
    ]
    for c in rows:
        cal = c["calibration"]
        lines.append(
            f"| `{c['name']}` | {c['describe']} | {_f(c['mean_abs_dlogp'])} | {_f(c['kl'], '.2e')} | "
            f"{_f(c['token_mult_prob_error'])} | {_f(c['noise_clip'])} | {_f(c['noise_clip_low'])} | "
            f"{_f(c['noise_clip_high'])} | {_f(cal['lower_onpolicy'], '.3f')} | "
            + " | ".join(_f(cal["lower_at_alpha"].get(a, {}).get("lower"), ".3f") for a in alphas) + " |")
    buckets = [b["positions"] for b in rep["configs"][0]["by_position"]] if rep["configs"] else []
    lines += ["", "## Against response position (mean abs dlogp / pure-noise clip share)", "",
              "| configuration | " + " | ".join(buckets) + " |", "|---|" + "---:|" * len(buckets)]
    for c in rows:
        cells = [f"{_f(b.get('mean_abs_dlogp'))} / {_f(b.get('noise_clip'))}" if b["tokens"] else "-"
                 for b in c["by_position"]]
        lines.append(f"| `{c['name']}` | " + " | ".join(cells) + " |")
    if rep["configs"]:
        counts = " | ".join(str(b["tokens"]) for b in rep["configs"][0]["by_position"])
        lines.append(f"| tokens | {counts} |")
    deciles = [b["p_ref"] for b in rep["configs"][0]["by_prob_decile"]] if rep["configs"] else []
    lines += ["", "## Pure-noise clip share by the token's high-precision probability", "",
              "| configuration | " + " | ".join(deciles) + " |", "|---|" + "---:|" * len(deciles)]
    for c in rows:
        lines.append(f"| `{c['name']}` | " + " | ".join(_f(b.get("noise_clip")) if b["tokens"] else "-"
                                                       for b in c["by_prob_decile"]) + " |")
    if rep["configs"]:
        lines.append("| tokens | " + " | ".join(str(b["tokens"]) for b in rep["configs"][0]["by_prob_decile"]) + " |")
    rk = rep["layer_ranking"]
    if rk.get("layers"):
        lines += ["", f"## Layers: mismatch drop with one layer in high precision (`{rk['config']}`, "
                      f"{rk['sequences']} sequences, {rk['tokens']} tokens, base mean abs dlogp "
                      f"{rk['base_mean_abs_dlogp']:.4f})", "",
                  "| rank | layer | mean abs dlogp | drop | share of base |", "|---:|---:|---:|---:|---:|"]
        for n, r in enumerate(rk["layers"][:10], 1):
            lines.append(f"| {n} | {r['layer']} | {r['mean_abs_dlogp']:.4f} | {r['drop']:.4f} | {_f(r['drop_share'], '.3f')} |")
    rec = rep["recommendation"]
    lines += ["", "## Recommendation", "", f"```\n{rec['line']}\n```", "", rec["why"] + "."]
    if rep.get("notes"):
        lines += ["", *[f"- {n}" for n in rep["notes"]]]
    lines += ["", "Definitions: docs/audit.md. Timings (s): "
              + ", ".join(f"{k} {v}" for k, v in rep["timings_s"].items()) + ".", ""]
    return "\n".join(lines)


def _figure(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    for c in _rows(rep):
        pos = [b for b in c["by_position"] if b["tokens"]]
        x = [b["positions"] for b in pos]
        ax[0, 0].plot(x, [b["mean_abs_dlogp"] for b in pos], marker="o", label=c["name"])
        ax[0, 1].plot(x, [b["noise_clip"] for b in pos], marker="o", label=c["name"])
        dec = [b for b in c["by_prob_decile"] if b["tokens"]]
        ax[1, 0].plot([b["p_ref"] for b in dec], [b["noise_clip"] for b in dec], marker="o", label=c["name"])
    ax[0, 0].set(title="mean |dlogp| vs high precision", xlabel="response position")
    ax[0, 1].set(title=f"pure-noise clips: r outside [{1 - rep['eps_low']:g}, {1 + rep['eps_high']:g}]",
                 xlabel="response position")
    ax[1, 0].set(title="pure-noise clips by high-precision token probability", xlabel="p(token)")
    ax[1, 0].tick_params(axis="x", rotation=45)
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    rk = rep["layer_ranking"]
    if rk.get("layers"):
        rows = sorted(rk["layers"], key=lambda r: r["layer"])
        ax[1, 1].bar([r["layer"] for r in rows], [r["drop"] for r in rows])
        ax[1, 1].set(title=f"mismatch drop, one layer in high precision ({rk['config']})", xlabel="layer",
                     ylabel="drop of mean |dlogp|")
    else:
        ax[1, 1].axis("off")
    fig.suptitle(f"FP8 audit: {rep['model']['name']} ({rep['response_tokens']} response tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(rep: dict, out_dir: Path) -> None:
    """``audit.json``, ``audit.md`` and ``audit.png`` in ``out_dir`` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "audit.json").write_text(json.dumps(rep, indent=1, allow_nan=True) + "\n")
    (out_dir / "audit.md").write_text(markdown(rep))
    _figure(rep, out_dir / "audit.png")
