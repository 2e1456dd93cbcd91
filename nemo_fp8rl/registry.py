"""One name -> object table, the pattern behind every pluggable choice (losses, advantage estimators,
rollout engines, tasks, FP8 recipes, calibration upper modes, rollout-correction modes).

Stdlib only, so that ``nemo_fp8rl.config`` and the submit-host tools can list names without importing
torch or a component. A registry knows the config key it serves, so every error names the key, the bad
value and the valid choices::

    POLICY_LOSSES = Registry("policy loss", "algorithm.policy_loss", plural="policy losses")

    @POLICY_LOSSES.register("ppo_clip")
    def ppo_clip_loss(...): ...

    POLICY_LOSSES.get("ppo_clip")   # the function
    POLICY_LOSSES.names()           # ['ppo_clip', ...]
    POLICY_LOSSES.check("nope")     # ValueError: unknown policy loss 'nope' (config key algorithm.policy_loss); registered policy losses: [...]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to objects for one kind of component.

    Args:
        kind: what the entries are, for messages ("policy loss", "rollout engine").
        config_key: the config key whose value is looked up here (``None`` when there is none).
        plural: ``kind`` in the plural, for messages (default ``kind + "s"``).
    """

    def __init__(self, kind: str, config_key: str | None = None, *, plural: str | None = None):
        self.kind = kind
        self.plural = plural or kind + "s"
        self.config_key = config_key
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, obj: T | None = None, *, aliases: Iterable[str] = ()):
        """Register ``obj`` under ``name`` (and ``aliases``); without ``obj``, a decorator that does.

        An empty name, or a name or alias that is already taken, raises ``ValueError`` (two plug-ins must
        not silently shadow each other).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        aliases = tuple(aliases)

        def add(o: T) -> T:
            for n in (name, *aliases):
                if n in self._entries or n in self._aliases:
                    have = self._entries.get(n, self._aliases.get(n))
                    raise ValueError(f"{self.kind} {n!r} is already registered ({have!r})")
            self._entries[name] = o
            for a in aliases:
                self._aliases[a] = name
            return o

        return add if obj is None else add(obj)

    def canonical(self, name: str) -> str:
        """``name`` with an alias replaced by the name it stands for; ``ValueError`` when unknown."""
        self.check(name)
        return self._aliases.get(name, name)

    def get(self, name: str) -> T:
        """The object registered under ``name`` (or an alias of it)."""
        return self._entries[self.canonical(name)]

    def names(self, include_aliases: bool = False) -> list[str]:
        """The registered names, sorted (plus the aliases when asked)."""
        out = list(self._entries)
        if include_aliases:
            out += list(self._aliases)
        return sorted(out)

    def check(self, name: object) -> None:
        """Raise ``ValueError`` naming the config key and the valid names unless ``name`` is registered."""
        if not isinstance(name, str) or (name not in self._entries and name not in self._aliases):
            key = f" (config key {self.config_key})" if self.config_key else ""
            raise ValueError(f"unknown {self.kind} {name!r}{key}; registered {self.plural}: {self.names()}")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def choices(kind: str, config_key: str, names: Iterable[str], *, plural: str | None = None) -> Registry[str]:
    """A registry of plain string choices (modes): each name maps to itself."""
    reg: Registry[str] = Registry(kind, config_key, plural=plural)
    for n in names:
        reg.register(n, n)
    return reg


__all__ = ["Registry", "choices"]
