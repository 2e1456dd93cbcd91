"""``summary.md`` (tables to read) and ``results.json`` (everything, tracebacks included) of a GPU check.

Each part module ``part_<name>.py`` may define ``headline(res) -> str`` (its row of the parts table)
and ``tables(res) -> list[str]`` (markdown lines of its own tables). Rendering never raises: the summary
of a run that measured something must be written whatever one part's result looks like.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def _hook(name: str, fn: str):
    try:
        return getattr(importlib.import_module(f"part_{name}"), fn, None)
    except Exception:  # noqa: BLE001  (a part module that does not import renders without its hooks)
        return None


def headline(name: str, res: dict) -> str:
    """One line for the parts table."""
    try:
        if "error" in res:
            return str(res["error"])[:300]
        if isinstance(res.get("skipped"), str):
            return f"skipped: {res['skipped']}"
        fn = _hook(name, "headline")
        text = fn(res) if fn else ""
        if "failed" in res:
            text = f"{res['failed']}; {text}" if text else str(res["failed"])
        return text
    except Exception as e:  # noqa: BLE001
        return f"(no headline: {type(e).__name__}: {e}; see results.json)"


def _tables(name: str, res: dict) -> list[str]:
    fn = _hook(name, "tables")
    if fn is None or "error" in res or isinstance(res.get("skipped"), str):
        return []
    try:
        return list(fn(res))
    except Exception as e:  # noqa: BLE001
        return [f"({name}: no table: {type(e).__name__}: {e})"]


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def write(out: Path, title: str, done: list, pending: list, meta: dict) -> None:
    """Rewrite ``summary.md``, ``results.json`` and (when a part raised) ``tracebacks.txt`` under ``out``.

    done: ``[(name, status, result dict)]`` in run order; pending: names not run yet.
    """
    lines = [title, "", "| part | status | seconds | result |", "|---|---|---|---|"]
    for name, status, res in done:
        lines.append(f"| {name} | {status} | {res.get('part_seconds', 0):.1f} | {_cell(headline(name, res))} |")
    for name in pending:
        lines.append(f"| {name} | not run | | |")
    for name, _, res in done:
        t = _tables(name, res)
        if t:
            lines += ["", *t]
    lines.append("")
    for name, status, res in done:
        body = json.dumps({k: v for k, v in res.items() if k not in ("traceback", "records", "output_tail")},
                          indent=1, default=str)[:4000]
        lines.append(f"## {name}: {status} ({res.get('part_seconds', 0):.1f}s)\n\n```json\n{body}\n```\n")
    (out / "summary.md").write_text("\n".join(lines))
    results = {"_meta": meta, **{n: {"status": s, **r} for n, s, r in done}}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    tbs = [f"===== {n}\n{r.get('traceback', '')}\n{r.get('output_tail', '')}" for n, _, r in done
           if r.get("traceback") or r.get("output_tail")]
    if tbs:
        (out / "tracebacks.txt").write_text("\n".join(tbs))
