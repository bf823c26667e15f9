"""Dependent questions: a question asked only when another question's answer matches.

`depends_on={"refund_reason": ("team", {"billing"})}` asks `refund_reason` only when the
final answer of `team` (canvas, re-read, escalated or fallback) is `billing`. Questions
without a condition are read first; each further layer (children of the layer before)
is read only for the children whose condition holds, all inside one decision. A child
whose condition fails, or whose parent was itself skipped, is reported as `skipped`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from canvasroute.engine import DecisionError

from ._questions import QuestionSpec

Condition = tuple[str, frozenset[str]]
"""(parent question id, the parent's answers that ask the child)."""


@dataclass(frozen=True, slots=True)
class Dependencies:
    """Validated conditions and the read order they imply."""

    conditions: Mapping[str, Condition]
    layers: tuple[tuple[str, ...], ...]
    """Question ids per read layer: layer 0 has no condition, layer n+1 depends on layer n."""

    def asked_if(self, qid: str, answers: Mapping[str, str | None]) -> dict[str, Any] | None:
        """The condition of `qid` as a JSON-able record (with the parent's final answer), or None."""
        if qid not in self.conditions:
            return None
        parent, wanted = self.conditions[qid]
        return {"question": parent, "answers": sorted(wanted), "parent_answer": answers.get(parent)}

    def applies(self, qid: str, answers: Mapping[str, str | None]) -> bool:
        """Whether `qid` is asked, given the final answers so far (None: skipped parent)."""
        if qid not in self.conditions:
            return True
        parent, wanted = self.conditions[qid]
        return answers.get(parent) in wanted


def parse_depends_on(depends_on: Any, specs: Mapping[str, QuestionSpec]) -> Dependencies:
    """Check `{child: (parent, answers)}` against the questions and order them in layers.

    `answers` is one option name or a collection of them (a Noul's `yes`/`no` or a bool,
    a Score's level as int or string).

    Raises:
        DecisionError: not a mapping of pairs, an unknown child or parent, an answer that is
            not an option of the parent, or a cycle.
    """
    if depends_on is None:
        return Dependencies({}, (tuple(specs),))
    if not isinstance(depends_on, Mapping):
        raise DecisionError("depends_on must be a mapping {question id: (parent id, answers)}")
    conditions: dict[str, Condition] = {}
    for child, cond in depends_on.items():
        if child not in specs:
            raise DecisionError(f"depends_on names {child!r}, which is not one of the questions")
        if not isinstance(cond, (tuple, list)) or len(cond) != 2 or not isinstance(cond[0], str):
            raise DecisionError(f"depends_on[{child!r}] must be a pair (parent id, answers), got {cond!r}")
        parent, raw = cond
        if parent not in specs:
            raise DecisionError(f"depends_on[{child!r}] names parent {parent!r}, which is not one of the questions")
        conditions[child] = (parent, _answers(child, specs[parent], raw))
    depth: dict[str, int] = {}
    for qid in specs:
        _depth(qid, conditions, depth, ())
    layers = [tuple(q for q in specs if depth[q] == d) for d in range(max(depth.values()) + 1)]
    return Dependencies(conditions, tuple(layers))


def _answers(child: str, parent: QuestionSpec, raw: Any) -> frozenset[str]:
    values = [raw] if isinstance(raw, (str, bool, int)) else raw
    if not isinstance(values, Collection) or not values:
        raise DecisionError(f"depends_on[{child!r}]: answers must be an option or a non-empty collection of options")
    out = set()
    for value in values:
        if isinstance(value, bool):
            value = "yes" if value else "no"
        name = str(value)
        if name not in parent.answer_options:
            raise DecisionError(f"depends_on[{child!r}]: {value!r} is not an answer of {parent.id!r} "
                                f"(one of {list(parent.answer_options)})")
        out.add(name)
    return frozenset(out)


def _depth(qid: str, conditions: Mapping[str, Condition], depth: dict[str, int], path: tuple[str, ...]) -> int:
    if qid in depth:
        return depth[qid]
    if qid in path:
        cycle = " -> ".join((*path[path.index(qid):], qid))
        raise DecisionError(f"depends_on has a cycle: {cycle}")
    d = 0 if qid not in conditions else _depth(conditions[qid][0], conditions, depth, (*path, qid)) + 1
    depth[qid] = d
    return d
