"""Hedged escalation: a borderline question's target call raced against its re-reads.

With `Escalation(hedge=Hedge(band=0.1))`, the questions of a stage whose first read the gate did
not pass by at most `band` (`Hedge.borderline`), and that are about to be re-read, are hedged:
ONE target call asks all of them at once, beside the re-reads (after `Hedge.after_s` of
re-reading alone), and whichever settles a question first answers it:

- the target answers first: its answer settles each question it answered (path `escalated`).
  The re-reads are cancelled when every question they read for is settled so; otherwise they
  finish for the others, and the settled question keeps their figures. A refusal settles
  nothing: that question waits for its re-reads, as without a hedge.
- the re-reads end first: a question the gate now passes is settled (path `reread`); one it
  still does not pass takes its cause's action as without a hedge, where `escalate` waits for
  the call already in flight instead of making another. When no hedged question waits for the
  call it is cancelled; when some do it runs on, and its answers for the questions the re-reads
  settled are dropped. A tie (both done when the race looks) goes to the target: its answer is
  already paid for.

Not hedged, and so re-read then escalated as without a hedge (in the stage's own call, beside a
hedge's): a question far over the gate, one that cannot be re-read, a two-read (routed) question,
every question when `OutcomePolicy.uncertain` is not `escalate`, and every question of a hedge
the budget refused.

Breaker: no hedge starts while the target's breaker is open (`Escalation.breaker`): the hedge is
`refused` (marked and counted, not logged: the breaker logged its opening) and its questions go
the sequential way, where the open breaker sends them to `OutcomePolicy.target_fault`. A hedge
call's failure counts toward opening the breaker as any call's does.

Budget: a hedge takes one grant per question when it starts, all or none (a partial grant is
given back, and the hedge is `refused`: logged, marked and counted, its questions go the
sequential way; so is a hedge whose meter raised, as a shared store down: the hedge was optional,
and the sequential escalation meets the meter again only if a question still needs it). A hedge
the re-reads beat after its call went out is not refunded: the target was asked and may have done
the work, so a budget caps target work, not only answers. A hedge is refunded, as any escalation
that did not happen, when its call never went out (cancelled first: nothing was asked, so it
never holds a grant a later escalation, of this decision's later stages or of another decision,
needs), when it failed, and when its decision raised or was cancelled while it ran.

Sync targets: a target whose async path is its sync code in a thread (`runs_in_thread`: a chat
model without `_agenerate`, a `RunnableLambda` over a plain function, ...) cannot be cancelled
once its thread runs. Its hedge calls run in `SYNC_HEDGES`, at most `SYNC_HEDGE_THREADS` at once
in this process; a hedge cancelled while its thread runs goes on to its end after the decision
has returned (its reply dropped, its grant spent): counted (`Diagnostics.hedges_ran_on`,
`Totals.hedges_ran_on`, the `canvasroute.hedges.ran_on` counter, `canvasroute.hedge.ran_on` on
its span). While every one of those threads is taken, a sync target's hedge is `refused` (its
questions go the sequential way), so a burst of cancelled hedges cannot pile up threads.

Faults: a hedge call that fails while the re-reads settle its questions is absorbed (their
answers stand): logged (WARNING, logger `canvasroute.router`), its `escalate` span marked
`failed` with an error status, counted (`canvasroute.hedges`, `canvasroute.hedge=failed`). A
question that still needs the call gets its failure as its escalation's and takes
`OutcomePolicy.target_fault` (beside an engine fault of its re-reads: its fallback, or an error
naming both). An engine fault in the re-reads is recorded on their questions as without a
hedge; such a question waits for the call when its fault escalates. A timeout is
`Escalation.timeout`, a failure like any. Cancelling the decision cancels both.

Traces and counts: a hedge's `escalate` span carries `canvasroute.hedge` (`won`, `cancelled`,
`failed`); the decide span a `canvasroute.hedge` event per hedge (`refused` ones too); each
question's report says `hedged`; `Diagnostics.target_calls` and `.hedges`, `Totals.target_calls`,
`.hedges` and `.hedges_cancelled` count them: a hedge is a target call once its call went out
(`Calls.sent`; the `escalate` span's `canvasroute.escalation.calls`), a hedge cancelled before, none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

from canvasroute.engine import EscalationError

from . import telemetry as tm
from ._escalation import Calls, Escalated, SyncThreads, runs_in_thread, target_name
from ._policy import Escalation, GatePolicy, Hedge
from ._read import QuestionRead

__all__ = ["SYNC_HEDGES", "SYNC_HEDGE_THREADS", "Hedging", "cancel", "joined"]

logger = logging.getLogger("canvasroute.router")

SYNC_HEDGE_THREADS = 8
"""Hedge calls to sync targets that may run at once in this process (cancelled ones running on included)."""
SYNC_HEDGES = SyncThreads(SYNC_HEDGE_THREADS)
"""Where every hedge call to a sync target runs (`runs_in_thread`)."""

Outcome = Literal["won", "cancelled", "failed", "refused"]


@dataclass(slots=True)
class Hedging:
    """One stage's hedge: what it asked, the call in flight, and how it ended (an async context:
    leaving it cancels a call still running and counts the hedge)."""

    hedge: Hedge
    escalation: Escalation
    thread: str | None
    """The LangGraph thread its budget grants are counted for."""
    gates: Mapping[str, GatePolicy]
    ask: Callable[[Sequence[QuestionRead], Calls], Coroutine[Any, Any, Escalated]]
    """One target call for these questions, marked as a hedge, counted in the `Calls` given."""
    escalates: Callable[[QuestionRead], bool]
    """Whether a read the gate has not passed goes to the target (its cause's action is `escalate`)."""
    usage: dict[str, int]
    """The decision's token usage: a call that answered adds its own, used or not."""
    ended: list[str]
    """The decision's hedge outcomes (`Diagnostics.hedges`): this one is added when it ends."""
    asked: tuple[str, ...] = ()
    """The questions the hedge call asks (none: no hedge was started)."""
    task: asyncio.Task[Escalated] | None = None
    calls: Calls = field(default_factory=Calls)
    """What the call handed the target (none: it was cancelled before it went out)."""
    won: set[str] = field(default_factory=set)
    """Questions the call answered before the re-reads ended."""
    outcome: Outcome | None = None
    needed: bool = False
    """A question took the call's answer, or needed it (its failure is then that question's, not absorbed here)."""

    async def __aenter__(self) -> Self:
        return self

    async def race(self, reads: dict[str, QuestionRead], rereading: list[str], candidates: list[str],
                   rereads: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run a stage's re-reads (`rereads`, for the questions in `rereading`) beside a hedge call
        for the borderline ones among `candidates`; return once the re-reads have ended or were
        cancelled because the call settled every question they read for."""
        hedged = [reads[q] for q in candidates if self._borderline(reads[q])]
        if not hedged:
            await rereads()
            return
        task = asyncio.create_task(rereads())
        try:
            if self.hedge.after_s:
                await asyncio.wait({task}, timeout=self.hedge.after_s)
            if task.done() or not await self._start(hedged):
                await task  # settled alone within `after_s`, or the budget refused the hedge
                return
            call = self.task
            assert call is not None
            await asyncio.wait({task, call}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and self._answered() and set(rereading) <= self.won:
                task.cancel()  # the target settled every question the re-reads read for
                await asyncio.wait({task})
                if task.cancelled():
                    return
            await task
            if not self._answered() and not any(self.escalates(reads[q]) for q in self.asked):
                await cancel(call)  # the re-reads settled every hedged question first
        finally:
            await cancel(task)

    def _borderline(self, r: QuestionRead) -> bool:
        """A first read that escalates if its re-reads do not settle it, and is over the gate by at most the band."""
        return (r.error is None and r.stats is not None and self.escalates(r)
                and self.hedge.borderline(self.gates[r.spec.id], r.stats))

    def _answered(self) -> bool:
        """Whether the call has answered (the first time it has, `won` takes the questions it answered)."""
        call = self.task
        if call is None or not call.done() or call.cancelled() or call.exception() is not None:
            return False
        if not self.won:
            self.won = {q for q in self.asked if q in call.result().answers}
        return True

    async def _start(self, hedged: Sequence[QuestionRead]) -> bool:
        """Take the budget for `hedged` and start the call (False: the budget refused it)."""
        meter, n = self.escalation.meter, len(hedged)
        ids = tuple(r.spec.id for r in hedged)
        threads = SYNC_HEDGES if runs_in_thread(self.escalation.target) else None
        breaker = self.escalation.breaker_state
        if breaker is not None and not breaker.allows():  # (not logged per decision: the breaker logged its opening)
            self.outcome = "refused"
            self._end(ids)
            return False
        if threads is not None and threads.busy():
            granted, why = 0, (f"its target is sync and all {threads.size} threads for sync hedge calls are taken "
                               "(calls that cannot be cancelled, still running)")
        else:
            try:
                granted = await meter.take(n, self.thread) if meter is not None else n
                if granted < n and granted:
                    await meter.refund(granted, self.thread)
                why = f"the escalation budget granted {granted} of {n}"
            except Exception as exc:  # noqa: BLE001 - a hedge is optional: a meter fault refuses it (logged, counted)
                granted, why = 0, f"the escalation budget could not be taken ({type(exc).__name__}: {exc})"
        if granted < n:
            self.outcome = "refused"
            logger.warning("hedge for question(s) %s refused: %s; re-reads first, then the escalation as without a "
                           "hedge", ", ".join(ids), why)
            self._end(ids)
            return False
        for r in hedged:
            r.hedged = True
        self.asked, self.calls = ids, Calls(threads=threads)
        self.task = asyncio.create_task(self.ask(hedged, self.calls))
        return True

    async def answers(self, reads: Mapping[str, QuestionRead]) -> Escalated | None:
        """The call's answers for the questions that take them: those it won and those that
        escalate after their re-reads (None: none does; a call still running is cancelled).

        Raises:
            EscalationError: the call failed and a question needs it.
        """
        call = self.task
        if call is None:
            return None
        use = [q for q in self.asked if q in self.won or self.escalates(reads[q])]
        if not use:
            await cancel(call)
            return None
        self.needed = True
        await asyncio.wait({call})
        result = call.result()
        return Escalated(result.model, {q: a for q, a in result.answers.items() if q in use},
                         {q: p for q, p in result.probabilities.items() if q in use}, {}, result.response_model,
                         confidence={q: c for q, c in result.confidence.items() if q in use},
                         refused={q: why for q, why in result.refused.items() if q in use})

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        call = self.task
        if call is None:
            return
        await cancel(call)
        failure = None if call.cancelled() else call.exception()
        self.outcome = "cancelled" if call.cancelled() else "failed" if failure is not None else "won"
        if self.outcome == "won":
            for key in ("input_tokens", "output_tokens"):
                self.usage[key] += call.result().usage.get(key, 0)
        meter = self.escalation.meter
        if meter is not None and (failure is not None or exc_type is not None or not self.calls.sent):
            await meter.refund(len(self.asked), self.thread)  # nothing was escalated by it, or nothing asked
        self._end(self.asked)
        if failure is not None and exc_type is None:
            if not isinstance(failure, EscalationError):
                raise failure  # not a target's failure: never absorbed
            if self.needed:
                return  # the questions that needed it took its failure (`OutcomePolicy.target_fault`): logged there
            logger.warning("hedge call to %s failed for question(s) %s, whose re-reads settled them (their answers "
                           "stand): %s", target_name(self.escalation.target), ", ".join(self.asked), failure)

    def _end(self, ids: Sequence[str]) -> None:
        assert self.outcome is not None
        self.ended.append(self.outcome)
        tm.record_hedge(self.outcome, ids)


async def cancel(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` if it still runs, and wait until it has ended (a cancellation of the caller
    still propagates); an exception it ended with is retrieved (its owner reads it, or another
    error is on its way)."""
    if task is None:
        return
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


def joined(first: Escalated | None, second: Escalated | None) -> Escalated | None:
    """Two calls' answers as one (for disjoint questions; usage summed)."""
    if first is None or second is None:
        return first or second
    return Escalated(second.model, {**first.answers, **second.answers},
                     {**first.probabilities, **second.probabilities},
                     {k: first.usage.get(k, 0) + second.usage.get(k, 0) for k in {*first.usage, *second.usage}},
                     second.response_model or first.response_model,
                     confidence={**first.confidence, **second.confidence}, refused={**first.refused, **second.refused})
