"""Every key of every YAML the package ships has a comment above or beside it.

YAML holds documented overrides only (defaults live in the schema): the trainer's Hydra configs
(``nemo_fp8rl/conf/**``: algorithm, calibration, fp8, model, parallel and task presets) and the launcher's
(``nemo_fp8rl/launcher/conf/**``: cluster and stages). The one check of this rule; other tests check
what the values of a preset are.
"""

from __future__ import annotations

import re

import pytest

from nemo_fp8rl.resources import PACKAGE_DIR, conf_dir, launcher_conf_dir

ROOTS = (conf_dir(), launcher_conf_dir())
FILES = sorted(p for root in ROOTS for p in root.rglob("*.yaml"))
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
# ``key:`` (a mapping entry): a colon followed by a space or the end of the line, outside quotes
MAPPING = re.compile(r"^[^#]*?:(\s|$)")


def _uncommented_lines(lines: list[str]) -> list[str]:
    """``line number: text`` of each line that needs a comment and has none above or beside it.

    Every line that is not blank, a comment, or a plain list value needs one: keys at any depth (the
    first key of a section too), list items that start a mapping (``- fp8: "off"``), continuation
    lines. Plain list values (``- _self_``) belong to the key above them and share its comment.
    "Beside" is a ``#`` after whitespace outside quotes (YAML's rule for a comment), "above" the line
    right before (a blank line in between breaks the link).
    """
    missing = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        code = QUOTED.sub("''", s)
        if code.startswith("- ") and not MAPPING.match(code[2:]):
            continue
        beside = re.search(r"\s#", code) is not None
        above = i > 0 and lines[i - 1].lstrip().startswith("#")
        if not (beside or above):
            missing.append(f"{i + 1}: {s}")
    return missing


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE_DIR)) for p in FILES])
def test_every_key_has_a_comment(path):
    missing = _uncommented_lines(path.read_text().splitlines())
    assert not missing, f"{path.relative_to(PACKAGE_DIR)}: lines without a comment above or beside them: {missing}"


def test_the_check_sees_every_shipped_config_group():
    """The parametrization is derived from the directories; an empty or misplaced root would silently
    test nothing, so every config group directory of both roots must contribute files."""
    groups = {p.parent for p in FILES}
    for root in ROOTS:
        assert root / "config.yaml" in FILES
        for d in (d for d in root.iterdir() if d.is_dir() and d.name != "__pycache__"):
            assert d in groups, f"{d}: a config group with no YAML seen by the check"
    assert {"task", "model", "rl", "cluster"} <= {d.name for d in groups}


def test_the_rule_flags_what_has_no_comment():
    """The checker itself: a section's first key, a mapping list item, a continuation line, a key whose
    comment is cut off by a blank line and a ``#`` inside quotes are flagged; plain list values are not."""
    ok = ["# the stages", "stages:", "  - rl", "# a section", "rl:", "  # its first key", "  a: 1",
          "  b: 2  # beside", "# a list of mappings", "- name: x", "- name: y  # beside", "  - _self_"]
    assert _uncommented_lines(ok) == []
    bad = ["# a section", "rl:", "  a: 1", "# a long value", "c: first part", "  second part", "b: 'x #y'",
           "# gap", "", "d: 3", "- e: 4", "- 'f: 5'"]
    assert _uncommented_lines(bad) == ["3: a: 1", "6: second part", "7: b: 'x #y'", "10: d: 3", "11: - e: 4"]
