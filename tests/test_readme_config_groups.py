"""README.md's list of Hydra config groups ("Config groups: `fp8={off,auto,...}`, ...") names exactly the
groups and options that nemo_fp8rl/conf/ holds as YAML files (``conf/<group>/<option>.yaml``), so the
list cannot go stale when a preset is added or removed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "nemo_fp8rl" / "conf"


def readme_config_groups(text: str) -> dict[str, set[str]]:
    """``{group: {options}}`` from the README paragraph that starts with "Config groups:" (up to its blank line)."""
    start = text.index("Config groups:")
    paragraph = text[start:].split("\n\n", 1)[0]
    groups: dict[str, set[str]] = {}
    for group, options in re.findall(r"`(\w+)=\{([^}`]*)\}`", paragraph):
        assert group not in groups, f"README.md lists the config group {group!r} twice"
        groups[group] = {o.strip() for o in options.split(",") if o.strip()}
    return groups


def conf_config_groups(conf: Path = CONF) -> dict[str, set[str]]:
    """``{group: {options}}``: every folder of ``conf`` holding YAML files, and the files' names."""
    return {d.name: {f.stem for f in d.glob("*.yaml")} for d in sorted(conf.iterdir())
            if d.is_dir() and any(d.glob("*.yaml"))}


def test_readme_lists_every_config_group_and_option():
    readme = readme_config_groups((ROOT / "README.md").read_text())
    conf = conf_config_groups()
    assert conf, f"no config groups found under {CONF}"
    problems = []
    for group in sorted(set(readme) | set(conf)):
        if group not in conf:
            problems.append(f"{group}: listed in README.md, but nemo_fp8rl/conf/{group}/ has no YAML files")
        elif group not in readme:
            problems.append(f"{group}: nemo_fp8rl/conf/{group}/ is not in README.md's list ({sorted(conf[group])})")
        else:
            for name, missing in (("README.md lacks", conf[group] - readme[group]),
                                  ("README.md lists, conf/ has no YAML for", readme[group] - conf[group])):
                if missing:
                    problems.append(f"{group}: {name} {sorted(missing)}")
    assert not problems, "README.md's config groups disagree with nemo_fp8rl/conf/:\n" + "\n".join(problems)


def test_the_parser_reads_the_readme_form(tmp_path):
    text = "x\n\nConfig groups: `a={x,y}`, `b={z}`\n`c={u, v}`; every key\nstill here\n\nConfig groups: `d={w}`\n"
    assert readme_config_groups(text) == {"a": {"x", "y"}, "b": {"z"}, "c": {"u", "v"}}
    for group, options in {"a": ["x", "y"], "b": []}.items():
        (tmp_path / group).mkdir()
        for o in options:
            (tmp_path / group / f"{o}.yaml").write_text("{}\n")
    (tmp_path / "config.yaml").write_text("{}\n")
    assert conf_config_groups(tmp_path) == {"a": {"x", "y"}}
