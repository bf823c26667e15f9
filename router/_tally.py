"""How a run's decisions ended, counted one way for every surface that shows it.

The demo's console summary, each decision event of a graph stream and the dashboard all
count with `Tally`, so they cannot disagree: one count per path (`ReadReport.path`), and
how many answers came from a read the gate did not pass ("over the gate": the read crossed
one of the gate's thresholds, whether it then escalated, was re-read to no avail or stayed
`unsure`), with the gate's own words (`GatePolicy.gate_text`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

from ._types import Path

__all__ = ["Tally"]

PATHS: tuple[str, ...] = get_args(Path)
"""Every path a decision can take, in the order they are shown."""
_WORDS = {"reread": "re-read"}
_ALWAYS = ("canvas", "reread", "escalated")
"""Shown even when zero."""


@dataclass(frozen=True, slots=True)
class Tally:
    """Counts of decisions by path, and of those over the gate."""

    PATHS: ClassVar[tuple[str, ...]] = PATHS
    paths: Mapping[str, int]
    """Every path, zeros included."""
    over_gate: int = 0
    gates: tuple[str, ...] = ()
    """The gates the reads were held to (distinct, in first-seen order)."""

    @classmethod
    def of(cls, decisions: Iterable[Any]) -> Tally:
        """Count `ReadReport`s, their JSON dumps, or anything with `path`, `crossed` and `gate`."""
        paths = dict.fromkeys(PATHS, 0)
        over, gates = 0, {}
        for d in decisions:
            if isinstance(d, Mapping):
                path, crossed, gate = d.get("path"), d.get("crossed"), d.get("gate")
            else:
                path, crossed, gate = getattr(d, "path", None), getattr(d, "crossed", None), getattr(d, "gate", None)
            if path not in paths:
                raise ValueError(f"unknown decision path {path!r}; paths are {', '.join(PATHS)}")
            paths[path] += 1
            over += bool(crossed)
            if gate:
                gates.setdefault(gate, None)
        return cls(paths, over, tuple(gates))

    @property
    def decisions(self) -> int:
        return sum(self.paths.values())

    def __add__(self, other: Tally) -> Tally:
        return Tally({p: self.paths[p] + other.paths[p] for p in PATHS}, self.over_gate + other.over_gate,
                     tuple(dict.fromkeys((*self.gates, *other.gates))))

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON: `{"decisions", "paths", "over_gate", "gates"}`."""
        return {"decisions": self.decisions, "paths": dict(self.paths), "over_gate": self.over_gate,
                "gates": list(self.gates)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tally:
        """The inverse of `as_dict` (e.g. summing the tallies of a stream's decision events)."""
        return cls({p: int(data["paths"].get(p, 0)) for p in PATHS}, int(data["over_gate"]), tuple(data["gates"]))

    def shares(self) -> str:
        """`canvas 2/9 (22%), re-read 0/9 (0%), escalated 0/9 (0%), unsure 7/9 (78%)`: paths taken
        (canvas, re-read and escalated always; the rest when they occur)."""
        n = self.decisions
        return ", ".join(f"{_WORDS.get(p, p)} {k}/{n} ({k / max(1, n):.0%})" for p, k in self.paths.items()
                         if k or p in _ALWAYS)

    def gate_line(self) -> str:
        """`over the gate: 7/9 (the gate passes H/lnK <= 0.5)`."""
        gates = "; ".join(self.gates) or "no read was gated"
        return f"over the gate: {self.over_gate}/{self.decisions} (the gate passes {gates})"
