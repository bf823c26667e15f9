"""Dependent questions: asked after others, with their answers restated, and only when they match.

`depends_on={"refund_reason": ("team", {"billing"})}` asks `refund_reason` only when the
final answer of `team` (canvas, re-read, escalated or fallback) is `billing`;
`depends_on={"reason": {"team": {"billing"}, "summary_first": None}}` names several
parents, each with the answers that ask the child or None (any answer: read after it).
Questions without parents are read first; each further stage (children of the stages
before) is read only for the children whose conditions all hold, all inside one decision,
with the parents' final answers restated after the state. A child whose condition fails,
or whose conditioning parent was itself skipped, is reported as `skipped`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from canvasroute.engine import SPECIAL_CANDIDATES, DecisionError, defuse

from ._questions import QuestionSpec, option_text

Parents = Mapping[str, frozenset[str] | None]
"""parent question id -> the parent's answers that ask the child (None: any answer)."""


@dataclass(frozen=True, slots=True)
class Dependencies:
    """Validated parents and the read order they imply."""

    parents: Mapping[str, Parents]
    """child -> its parents and their conditions."""
    layers: tuple[tuple[str, ...], ...]
    """Question ids per read stage: stage 0 has no parent, stage n+1 depends on earlier ones."""

    def key(self) -> str:
        """The dependencies as one stable string (for the decision cache)."""
        return json.dumps(sorted((c, sorted((p, sorted(a) if a is not None else None) for p, a in ps.items()))
                                 for c, ps in self.parents.items()))

    def asked_if(self, qid: str, answers: Mapping[str, str | None]) -> dict[str, Any] | None:
        """The condition that decides `qid` as a JSON-able record (the first that fails, else
        the first), with the parent's final answer; None when it has no condition."""
        if qid not in self.parents:
            return None
        conditions = [(p, a) for p, a in self.parents[qid].items() if a is not None]
        if not conditions:
            return None
        parent, wanted = next(((p, a) for p, a in conditions if answers.get(p) not in a), conditions[0])
        return {"question": parent, "answers": sorted(wanted), "parent_answer": answers.get(parent)}

    def applies(self, qid: str, answers: Mapping[str, str | None]) -> bool:
        """Whether `qid` is asked, given the final answers so far (None: skipped parent)."""
        return qid not in self.parents or all(answers.get(p) in a for p, a in self.parents.get(qid, {}).items() if a is not None)

    def restated(self, asked: Sequence[str], answers: Mapping[str, str | None], specs: Mapping[str, QuestionSpec],
                 special_tokens: Sequence[str] | None = None) -> str:
        """What a stage reads after the state: its questions' parents' final answers (defused)."""
        if not self.parents:
            return ""
        parents = {p for q in asked for p in self.parents.get(q, {})}
        lines = [f"- {option_text(specs[p].question.instructions)}: {_shown(specs[p], answers[p])}"
                 for p in specs if p in parents and answers.get(p) is not None]
        if not lines:
            return ""
        text = "\n\nEarlier answers about this input:\n" + "\n".join(lines)
        return defuse(text, special_tokens or SPECIAL_CANDIDATES)


def _shown(spec: QuestionSpec, answer: str | None) -> str:
    """An answer as text: yes/no, the option's name, or a Score level's description."""
    if spec.kind == "score" and answer is not None:
        return spec.descriptions[int(answer)] or answer
    return str(answer)


def parse_depends_on(depends_on: Any, specs: Mapping[str, QuestionSpec]) -> Dependencies:
    """Check `{child: (parent, answers) | {parent: answers or None}}` against the questions
    and order them in stages.

    `answers` is one option name or a collection of them (a Noul's `yes`/`no` or a bool,
    a Score's level as int or string).

    Raises:
        DecisionError: not a mapping of pairs or of parents, an unknown child or parent, an
            answer that is not an option of the parent, or a cycle.
    """
    if depends_on is None:
        return Dependencies({}, (tuple(specs),))
    if not isinstance(depends_on, Mapping):
        raise DecisionError("depends_on must be a mapping {question id: (parent id, answers)}")
    parents: dict[str, Parents] = {}
    for child, cond in depends_on.items():
        if child not in specs:
            raise DecisionError(f"depends_on names {child!r}, which is not one of the questions")
        if isinstance(cond, (tuple, list)) and len(cond) == 2 and isinstance(cond[0], str):
            cond = {cond[0]: cond[1]}
        elif not isinstance(cond, Mapping) or not cond:
            raise DecisionError(f"depends_on[{child!r}] must be a pair (parent id, answers) or a mapping "
                                f"{{parent id: answers or None}}, got {cond!r}")
        mine: dict[str, frozenset[str] | None] = {}
        for parent, raw in cond.items():
            if parent not in specs:
                raise DecisionError(f"depends_on[{child!r}] names parent {parent!r}, which is not one of the "
                                    "questions")
            mine[parent] = None if raw is None else _answers(child, specs[parent], raw)
        parents[child] = mine
    depth: dict[str, int] = {}
    for qid in specs:
        _depth(qid, parents, depth, ())
    layers = [tuple(q for q in specs if depth[q] == d) for d in range(max(depth.values()) + 1)]
    return Dependencies(parents, tuple(q for q in layers if q))


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


def _depth(qid: str, parents: Mapping[str, Parents], depth: dict[str, int], path: tuple[str, ...]) -> int:
    if qid in depth:
        return depth[qid]
    if qid in path:
        cycle = " -> ".join((*path[path.index(qid):], qid))
        raise DecisionError(f"depends_on has a cycle: {cycle}")
    d = max((_depth(p, parents, depth, (*path, qid)) + 1 for p in parents.get(qid, {})), default=0)
    depth[qid] = d
    return d
