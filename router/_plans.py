"""The plans a model keeps: one per asked question set (as read: abstain labels, order
views, questions read alone, a thought first), and the in-group plans of questions read
in two steps, each made once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from canvasroute.engine import Engine, EngineInfo

from ._length import check_length
from ._options import ReadOptions
from ._plan import Plan, plan
from ._policy import GatePolicy
from ._questions import QuestionSpec, with_abstain

KEEP = 256
"""Plans kept (least recently used dropped first)."""


def shaped(specs: Mapping[str, QuestionSpec], asked: Sequence[str], policy: GatePolicy) -> dict[str, QuestionSpec]:
    """The asked questions as read: with their abstain label where their policy abstains."""
    return {qid: with_abstain(specs[qid]) if policy.for_question(qid).abstain else specs[qid] for qid in asked}


@dataclass(slots=True)
class Planner:
    """One engine's plans, by key (an LRU of `KEEP`)."""

    engine: Engine
    plans: OrderedDict[Any, Plan] = field(default_factory=OrderedDict)

    async def layer(self, key: str, specs: Mapping[str, QuestionSpec], asked: Sequence[str],
                    policy: GatePolicy, opts: ReadOptions) -> Plan:
        """The plan of the asked questions of a question set (`key`: the set's key)."""
        read = shaped(specs, asked, policy)
        views = {qid: policy.for_question(qid).order_views for qid in asked if policy.for_question(qid).order_views}
        alone = sorted(opts.alone.intersection(asked))
        plan_key: Any = key
        if len(asked) != len(specs) or views or alone or opts.think or any(s.abstain for s in read.values()):
            plan_key = (key, tuple(asked), tuple(q for q, s in read.items() if s.abstain), tuple(views.items()),
                        tuple(alone), bool(opts.think))
        return await self._get(plan_key, read, views, alone, "" if opts.think else None)

    async def member(self, the_plan: Plan, qid: str, group: int) -> Plan:
        """The in-group plan of a question read in two steps."""
        spec = the_plan.routes[qid].member_spec(the_plan.specs[qid], group)
        return await self._get(("member", qid, spec.question.model_dump_json()), {qid: spec})

    async def check(self, info: EngineInfo, state_text: str, key: str, specs: Mapping[str, QuestionSpec],
                    layers: Sequence[Sequence[str]], policy: GatePolicy, opts: ReadOptions) -> None:
        """`InputTooLong` unless every read of every layer (all of it asked) fits the model."""
        for layer in layers:
            await check_length(self.engine, info, await self.layer(key, specs, layer, policy, opts), state_text,
                               self.member, opts)

    async def _get(self, key: Any, specs: Mapping[str, QuestionSpec], views: Mapping[str, int] | None = None,
                   alone: Sequence[str] = (), canvas_prefix: str | None = None) -> Plan:
        plans = self.plans
        if key not in plans:
            plans[key] = await plan(self.engine, specs, views, alone=alone, canvas_prefix=canvas_prefix)
            while len(plans) > KEEP:
                plans.popitem(last=False)
        plans.move_to_end(key)
        return plans[key]
