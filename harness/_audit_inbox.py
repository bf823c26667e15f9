"""`AuditInbox`: the review lane as live certification's labeller.

`Audit(rate=..., labels="review", reviewer=AuditInbox(store))`: each audit (an answer the gate
passed, sampled in the background; with people as labellers, every sampled answer) becomes an
item in a LangGraph store under `("canvasroute", "audit-inbox", scope)`, and waits until a person
labels it: `inbox.pending()` lists the items (the questions, their options, the state when
`include_state`), `inbox.answer(key, {question_id: option})` labels one, from any process sharing
the store (a `PostgresStore` for a fleet; an `InMemoryStore`, the default, in one process).

The items are blind: they show the question and the state, never the canvas's answer or its
distribution, so a reviewer labels rather than approves. An item nobody labels within the audit's
timeout (`Audit.timeout`, an hour by default) is withdrawn and counts as a disagreement (who
skips an item may skip it for a reason); one a person labels with `None` for a question declines
that question, which counts the same. What the live certificate then bounds is the rate at
which the canvas disagrees with people: with careful reviewers, its error rate.

Unlike `ReviewPolicy`'s `interrupt()`, nothing pauses: the decision that was audited has already
answered; its row counts once the person's label arrives (the rows of later decisions wait for it,
in order: `canvasroute.router._audit`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from langgraph.store.base import BaseStore
from langgraph.store.memory import InMemoryStore

from canvasroute.engine import DecisionError
from canvasroute.router import Asked

from ._store_budget import search_all

__all__ = ["AuditInbox"]


class AuditInbox:
    """People label audited answers: items in a LangGraph store, answered from any process.

    Args:
        store: where the items wait (default: an `InMemoryStore` of this process).
        scope: names this inbox in the store: `("canvasroute", "audit-inbox", scope)`.
        poll_s: seconds between two looks at an item waiting for its label.
        include_state: put the decision state into each item, so the reviewer sees what was asked.

    Example:
        ```python
        inbox = AuditInbox(store)
        model = CanvasDecisionModel(engine=..., policy=GatePolicy(rereads=0), escalate_to=Escalation(
            target, audit=Audit(rate=0.01, labels="review", reviewer=inbox)))
        for item in inbox.pending():                       # a reviewer's tool, in any process
            inbox.answer(item["key"], {"team": "billing"})
        ```
    """

    name = "reviewers"
    """Whose labels these are, in the certificate's words."""

    def __init__(self, store: BaseStore | None = None, *, scope: str = "default", poll_s: float = 1.0,
                 include_state: bool = True) -> None:
        if store is not None and not isinstance(store, BaseStore):
            raise TypeError(f"store must be a langgraph BaseStore, not {type(store).__name__}")
        if not 0.0 < poll_s < 3600.0:
            raise ValueError(f"poll_s must be a positive number of seconds, got {poll_s!r}")
        self.store = store if store is not None else InMemoryStore()
        self.namespace = ("canvasroute", "audit-inbox", scope)
        self.poll_s = poll_s
        self.include_state = include_state

    def __repr__(self) -> str:
        return f"AuditInbox({type(self.store).__name__}, namespace={self.namespace!r})"

    async def label(self, asked: Asked) -> dict[str, str | None]:
        """Put one item and wait for a person's labels (withdrawn when cancelled, or timed out by the caller)."""
        key = uuid.uuid4().hex
        questions = {s.id: {"instructions": getattr(s.question, "instructions", None), "options": list(s.options)}
                     for s in asked.specs}
        value: dict[str, Any] = {"ts": time.time(), "questions": questions, "answers": None}
        if self.include_state:
            value["state"] = asked.text + asked.restated
        await self.store.aput(self.namespace, key, value, index=False)
        try:
            while True:
                await asyncio.sleep(self.poll_s)
                item = await self.store.aget(self.namespace, key)
                answers = item.value.get("answers") if item is not None else None
                if isinstance(answers, Mapping):
                    return {qid: answers.get(qid) for qid in questions}
        finally:
            await asyncio.shield(self.store.adelete(self.namespace, key))

    def pending(self) -> list[dict[str, Any]]:
        """The items waiting for a label, oldest first: `key`, `questions` ({id: instructions, options}), `state`."""
        items = self.store.search(self.namespace, limit=10_000)
        return sorted(({"key": i.key, **i.value} for i in items if i.value.get("answers") is None),
                      key=lambda v: v.get("ts", 0.0))

    async def apending(self) -> list[dict[str, Any]]:
        """`pending`, for async code."""
        found = [{"key": i.key, **i.value} async for i in search_all(self.store, self.namespace)]
        return sorted((v for v in found if v.get("answers") is None), key=lambda v: v.get("ts", 0.0))

    def answer(self, key: str, answers: Mapping[str, str | None]) -> None:
        """Label one item: an option per question of it (None: declined, a disagreement).

        Raises:
            DecisionError: no such item waiting, a question it does not ask, or an option it does not have.
        """
        item = self.store.get(self.namespace, key)
        self.store.put(self.namespace, key, self._answered(key, item, answers), index=False)

    async def aanswer(self, key: str, answers: Mapping[str, str | None]) -> None:
        """`answer`, for async code."""
        item = await self.store.aget(self.namespace, key)
        await self.store.aput(self.namespace, key, self._answered(key, item, answers), index=False)

    @staticmethod
    def _answered(key: str, item: Any, answers: Mapping[str, str | None]) -> dict[str, Any]:
        if item is None or item.value.get("answers") is not None:
            raise DecisionError(f"no audit item {key!r} is waiting for a label", hint="list them with pending()")
        asked = item.value.get("questions") or {}
        if not isinstance(answers, Mapping) or not set(answers) <= set(asked):
            raise DecisionError(f"audit item {key!r} asks {sorted(asked)}; the labels name "
                                f"{sorted(answers) if isinstance(answers, Mapping) else answers!r}")
        for qid, option in answers.items():
            if option is not None and option not in asked[qid]["options"]:
                raise DecisionError(f"{option!r} is not an option of {qid!r}; options: {asked[qid]['options']}")
        return {**item.value, "answers": {qid: answers.get(qid) for qid in asked}}
