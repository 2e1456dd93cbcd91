"""Part (b), ``pytest -m gpu`` over every test file that has ``gpu`` tests (found by their marker), in
one pytest run; tests that need Transformer Engine or vLLM skip with their reason (``-rs``). The full
output goes to ``pytest_gpu.txt`` under the output folder. Exit codes 0 (all passed or skipped) and 5
(nothing selected) are fine; anything else fails the part."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[str]:
    """Test files that mark tests ``gpu`` (``pytest.mark.gpu`` / ``pytestmark = pytest.mark.gpu``)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def run(ctx) -> dict:
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", *files]
    res = ctx.res
    res.update(files=files, cmd=" ".join(cmd[1:]))
    log = ctx.out / "pytest_gpu.txt"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left() - 5, 10), cwd=REPO,
                              check=False)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
        res["failed"] = "pytest timed out"
    log.write_text(text + f"\nexit code {rc}\n")
    res["rc"] = rc
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)", ln)]
    res["outcome"] = last[-1].strip("= ") if last else None
    res["counts"] = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", res["outcome"] or "")}
    res["skip_reasons"] = sorted({m.strip() for m in re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", text, re.M)})[:20]
    if rc not in (0, 5) and "failed" not in res:
        res["failed"] = f"pytest exit code {rc}: {res['outcome']}"
    return res


def headline(res: dict) -> str:
    return f"{res.get('outcome')} (pytest_gpu.txt); skip reasons: {'; '.join(r[:70] for r in res.get('skip_reasons', [])[:3])}"
