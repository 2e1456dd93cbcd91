"""Every key in conf/ YAML files has a comment above or beside it (YAML holds documented overrides only)."""

from pathlib import Path

import pytest

CONF = Path(__file__).resolve().parent.parent / "conf"
FILES = sorted(CONF.rglob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CONF)) for p in FILES])
def test_every_key_has_a_comment(path):
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("- ") or ":" not in s:
            continue
        key_line = "#" in line.split(":", 1)[1]
        prev = lines[i - 1].strip() if i else ""
        assert key_line or prev.startswith("#") or prev.endswith(":"), f"{path.name}:{i + 1}: {s!r} has no comment"
