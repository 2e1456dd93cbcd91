"""Every relative link in README.md and docs/ points at a file of the repository (and a heading, when it
names one), and every repository path the docs quote in backticks exists: the docs are self-contained.

Checked: inline links and images ``[text](target)`` / ``![alt](target)``, reference definitions
``[id]: target``, ``#anchor`` parts (GitHub's heading slugs), and inline-code paths that start with a
top-level folder of the repository (``docs/results.md``, ``tests/_fp8_bounds.py``). Links with a scheme
(``https:``, ``mailto:``) and anything inside fenced code blocks are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# inline code that names a file of the repository: a top-level folder, then a path with an extension
_TOP = ("docs", "tests", "benchmarks", "nemo_fp8rl", "examples", "scripts", "launchers", "conf")
_REPO_PATH = re.compile(r"^(?:%s)/[\w./-]*\.\w+$" % "|".join(_TOP))


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces -> '-'."""
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    h = h.replace("`", "").strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        s = _slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in ``path`` outside code."""
    found = []
    for i, line in _prose_lines(path.read_text(encoding="utf-8")):
        prose = _INLINE_CODE.sub("", line)
        found += [(i, m.group(1)) for m in _LINK.finditer(prose)]
        m = _REF_DEF.match(prose)
        if m:
            found.append((i, m.group(1)))
    return found


def quoted_paths(path: Path) -> list[tuple[int, str]]:
    """(line, path) of inline-code spans that name a repository file."""
    found = []
    for i, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in _INLINE_CODE.finditer(line):
            code = m.group(2).strip()
            if _REPO_PATH.match(code):
                found.append((i, code))
    return found


def broken_links(path: Path) -> list[str]:
    """Messages for the links of ``path`` whose file or heading does not exist."""
    problems = []
    for line, target in links(path):
        if _SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(REPO)}:{line}: ({target})"
        if REPO not in dest.parents and dest != REPO:
            problems.append(f"{where} points outside the repository")
        elif not dest.exists():
            problems.append(f"{where} -> {dest.relative_to(REPO)} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading '#{anchor}' in {dest.relative_to(REPO)}")
    return problems


def missing_quoted_paths(path: Path) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: `{p}` does not exist"
            for line, p in quoted_paths(path) if not (REPO / p).exists()]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_resolve(doc):
    problems = broken_links(doc)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_quoted_repository_paths_exist(doc):
    problems = missing_quoted_paths(doc)
    assert not problems, "\n".join(problems)


def test_checker_catches_a_broken_link_and_anchor(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing heading and a path outside the repo are reported."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Some Title: `x`\n")
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("[ok](b.md#some-title-x) [gone](c.md) [bad](b.md#nope) [out](../../x.md)\n"
                   "```\n[in code](ignored.md)\n```\n`[in code](ignored.md)` [web](https://example.org)\n"
                   "`docs/b.md` `docs/none.md`\n")
    problems = broken_links(doc)
    assert len(problems) == 3, problems
    assert "c.md does not exist" in problems[0] and "#nope" in problems[1] and "outside" in problems[2]
    assert missing_quoted_paths(doc) == ["docs/a.md:6: `docs/none.md` does not exist"]
