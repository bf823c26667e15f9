"""Live certification: each question's threshold certified on its own traffic, at every moment.

`Escalation(audit=Audit(rate=0.02, max_error=0.05, confidence=0.9))`. Per question under it, the
candidate thresholds `Audit.thresholds` (lambda_1 < ... < lambda_J, fixed in advance) are tested,
strict to loose, on labelled rows from the live traffic; the gate passes at the loosest one
certified. What follows states the rows, the test, what it certifies, and under what assumptions.

**The rows.** Before a decision is read, one uniform draw `u` (the audit coin, from its own
random generator, never from the decision) samples each live question of it with rate `pi`:
`pi = 1` while the question passes nothing and its uncertain answers escalate to the target that
labels (every answer escalates, and its label costs no extra call), `BOOST` times `Audit.rate`
while a drift is suspected (below), else `pi = Audit.rate`; `pi` depends on the past only. A
sampled question whose canvas read passed or would pass at some candidate (its only crossing,
if any, is the entropy threshold, and it did not abstain) is one row `(s, Z)`: `s` its
normalized entropy, `Z = 1` when the canvas answer (its best real option) differs from the
labeller's. Its label is

- for an answer the gate passed: an **audit**, one call to the labeller in the background, blind
  (it is not shown the canvas's distribution), spending the escalation budget as an escalation does;
- for an answer the gate did not pass and the target answered (path `escalated`): that answer,
  free, when the target is the labeller (it saw the canvas's distribution as a hint, as every
  escalation does); a refusal counts as `Z = 1`. With people as labellers, an audit too.

A row counts for every candidate `lambda_j >= s`, whatever threshold was in force: the answer
a stricter candidate would pass is an audited passed answer, and the one a looser candidate
would pass beyond the current threshold is an escalated one, labelled anyway. Escalated answers
are free rows for looser candidates, but only the sampled ones: taking every escalated answer
and a `rate` share of the passed ones would over-represent the answers past the threshold in
a looser candidate's rows (an importance-weighted alternative, as in A-RCPS, takes them all at
the price of bets capped near `rate`; this module thins instead).

Because the coin never looks at the decision, the rows of candidate j are an independent sample
of the decisions it passes, so `E[Z] = r_j`, the rate at which the answers lambda_j passes
disagree with the labeller. Missing labels: a row whose label is lost to load (the budget spent
for its audit or escalation, every audit slot taken when the decision started, the labeller's
transport failing) is left out, with every row of its decision; this keeps the sample unbiased
when load does not depend on the answers. A row whose labeller declined or never answered (a
refusal, a reply outside the options, a review item that expired) counts as a disagreement:
those can depend on the item, and counting them against the gate is always safe. Rows enter
the test in the order their decisions ended, each worker's in order however its audits
return (a finished audit waits for the earlier ones), so the order never depends on a label.

**The test.** Per candidate j, with `n_j` rows and `k_j` disagreements since the last reset,
the e-value for `H_j: r_j > a` mixes, uniformly over the bet f in [0, 1], the capital of betting
the fraction f on `Z = 0` at the odds fair for rate `a` (Waudby-Smith & Ramdas, "Estimating means
of bounded random variables by betting", JRSS-B 2024; the uniform mixture is Cover's universal
portfolio over constant bets):

    E_j(a) = integral over f in [0, 1] of  (1 + f a / (1 - a)) ** (n_j - k_j) * (1 - f) ** k_j  df

(in closed form through the incomplete beta function, `log_evalue`). Each bet's factor has mean
`1 + f (a - r) / (1 - a) <= 1` when `r >= a`, so each bet's capital, and the mixture, is a
nonnegative supermartingale starting at 1 under `H_j`, and by Ville's inequality
`P(E_j(a) >= 1/delta at some time) <= delta`. `u_j = inf{a : E_j(a) >= 1/delta}` is an
anytime-valid upper confidence sequence for `r_j` (`upper_bound`): `P(r_j > u_j at some time)
<= delta`. The mixture depends on the counts only, not on their order. With no disagreement,
about 70 rows certify 5 % at 90 % (Clopper-Pearson at one fixed n would need 45: the price of
holding at every n).

**Which threshold.** Fixed-sequence testing (Bauer 1991; Angelopoulos et al., "Learn then Test",
2021): walk j = 1, 2, ... while `E_j(max_error) >= 1/delta_e`, and pass at the last such
candidate. A certified set that holds a true null holds the first true null of the sequence,
whose e-process crossed: so `P(at any time some certified candidate has r_j > max_error) <=
delta_e`, for this question, with any dependence between candidates. The gate tightens at once
when a crossing is lost (the counts moved back), and when the drift detector below fires. The
sequence starts at the strictest candidate whatever the traffic: a grid whose first thresholds
the reads never reach certifies nothing (a worker says so in its log after `STALLED` rows), so
start `Audit.thresholds` where the traffic is (an offline calibration shows where).

**Drift.** Stationarity is what Ville needs; old rows also make a cumulative e-value slow to
notice a change. So each candidate runs an e-detector on its rows: the mean of four e-CUSUMs,
`D = max(D, 1) * (1 + g (Z - max_error))`, each with the Kelly bet `g` against a rate 1.5, 2, 3
or 5 times `max_error` (Shin, Ramdas, Rinaldo, "E-detectors: a nonparametric framework for
sequential change detection", NEJSDS 2024; a mean of e-detectors is one). The certified
candidate's detector can fire: while its rate holds, each factor has mean <= 1, and false alarms
come at most once per `Audit.alarm` of its rows on average. Half-way to an alarm the question is
audited `BOOST` times faster (a rate chosen from the past: the rows stay a sample of the traffic,
and a suspected drift is confirmed or cleared sooner). An alarm resets the question: a new
epoch, its rows from zero, the gate passing nothing again until the new rows certify. Epoch e
tests at `delta_e = delta * 6 / (pi^2 e^2)` (their sum is delta), so over every epoch of a
stationary stream the chance that any certified candidate is wrong at any moment stays <= delta.
Under drift nothing holds between a change and its alarm (or the e-value's own loss of the
threshold): the certified threshold may pass answers worse than `max_error` for the detector's
delay, which grows as the change shrinks (a change to 1.5 times the target takes on the order of
a thousand rows at the threshold: `canvasroute bench --only live` measures it); after the alarm
the guarantee holds again if the traffic then stays put.

**Across workers.** Each worker (a `StoreLiveState` per process) owns one item in the graph
store holding, per question, its epoch and its counts per candidate, read and written by the
controller's mechanism (`canvasroute.harness._store_control`). A worker tests the pooled counts:
its own, plus every other worker's of the same epoch as last read. Since the e-value is a
function of the counts, the pooled value is the e-value of the merged row sequence in any order;
each worker's rows are in order, and the guarantee needs only that which worker's next row is
counted first does not depend on its label (labelling delays independent of the answers). A
worker that sees a later epoch adopts it and zeroes its own counts; its alarm starts one. Its
detectors read its own rows one by one and the others' in batches at each read (restarting only
between batches: fewer false alarms, no validity lost).

**With the rest.** The escalation-rate controller steers on top of the live threshold: a live
certified gate is a certified gate, so the controller only tightens it unless `loosen_certified`,
and a gate it moved claims nothing (as for an offline certificate; its rows still count). Caches:
a live gate's threshold and claim are part of the request's key (its moving figures are not,
`LiveFigures`), a cache hit is not a decision and is neither sampled nor counted. Budget: every
audit takes the escalation budget first; one it refuses is dropped, never sent. Hedges race
re-reads, which live questions have none of. Re-reads: with them, which reads a decision gets
depends on the threshold in force, so rows gathered under one threshold do not describe another:
a question with `rereads > 0` is not certified live (`live_gated`).

**What is certified.** Disagreement with the labeller: the escalation target (a model: its
errors are not seen), or people through the review lane (then, their labels' error). Per question
and candidate; for the decisions the model made (a cache replay is the same decision again).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import math
import random
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from canvasroute.engine import EscalationError

from . import telemetry as tm
from ._breaker import watched
from ._escalation import Asked, Calls, Restated, escalate, target_name
from ._policy import Audit, Certificate, GatePolicy, LiveFigures, LiveSetting
from ._questions import QuestionSpec

if TYPE_CHECKING:
    from ._request import DecisionRequest
    from ._types import ReadReport

__all__ = ["InMemoryLiveState", "Labeller", "LiveSetting", "Ticket", "certified_index", "epoch_delta",
           "live_gated", "live_steered", "log_evalue", "observe", "steer", "upper_bound"]

logger = logging.getLogger("canvasroute.router")

KEEP = 4096
"""Questions a state keeps (least recently decided dropped first)."""
METHOD = "live-dkelly"
"""`Certificate.method` of a live certificate."""
STALLED = 200
"""Rows at the loosest candidate, none at the strictest, after which a worker says the grid starts too low."""
BOOST = 4.0
"""How much faster a question is audited while its certified candidate's drift detector is half-way to
an alarm (the rate still at most 1): a suspected drift is confirmed, or cleared, sooner."""
REVIEW_TIMEOUT = 3600.0
"""Seconds an audit in the review lane waits for a person (`Audit.timeout` None)."""


# -- the e-values ---------------------------------------------------------------------------


def _log_betainc(a: float, b: float, x: float) -> float:
    """log of the regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 < x < 1
    (the continued fraction of Numerical Recipes' `betacf`, by the modified Lentz method)."""
    if x > (a + 1.0) / (a + b + 2.0):  # converges fast on this side: I_x(a, b) = 1 - I_{1-x}(b, a)
        return math.log1p(-math.exp(_log_betainc(b, a, 1.0 - x)))
    front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)) - math.log(a)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front + math.log(h)


def log_evalue(n: int, k: int, a: float) -> float:
    """log E(a): the e-value against "the disagreement rate exceeds `a`" after `n` rows, `k` of
    them disagreements (0 with no rows): the mixture over every bet f in [0, 1], uniformly, of
    `(1 + f a / (1 - a)) ** (n - k) * (1 - f) ** k`, in closed form
    `a^-(k+1) (1-a)^-(n-k) B(k+1, n-k+1) I_a(k+1, n-k+1)`.

    Example:
        ```python
        log_evalue(71, 0, 0.05) > math.log(10)   # True: 71 agreeing rows certify 5 % at 90 %
        ```
    """
    if n <= 0:
        return 0.0
    if a >= 1.0:
        return math.inf
    x, y = k + 1.0, n - k + 1.0
    return (-x * math.log(a) - (n - k) * math.log1p(-a) + math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)
            + _log_betainc(x, y, a))


@functools.lru_cache(maxsize=4096)
def upper_bound(n: int, k: int, delta: float) -> float:
    """The anytime-valid upper confidence bound on the disagreement rate at level `delta`:
    `inf{a : E(a) >= 1/delta}` (1 with no rows), to 1e-5 (rounded up)."""
    goal = -math.log(delta)
    if n <= 0:
        return 1.0
    low, high = k / n, 1.0  # E(a) grows with a; at the observed rate it is below 1
    while high - low > 1e-5:
        mid = (low + high) / 2
        low, high = (low, mid) if log_evalue(n, k, mid) >= goal else (mid, high)
    return high


def epoch_delta(delta: float, epoch: int) -> float:
    """The level epoch `epoch` (1, 2, ...) tests at: `delta * 6 / (pi^2 epoch^2)` (they sum to `delta`)."""
    return delta * 6.0 / (math.pi ** 2 * epoch ** 2)


def certified_index(n: Sequence[int], k: Sequence[int], max_error: float, delta: float) -> int:
    """Fixed-sequence testing: the last index j of the run j = 0, 1, ... whose e-value against
    `r_j > max_error` reaches `1/delta` (-1: not even the first)."""
    goal, found = -math.log(delta), -1
    for j in range(len(n)):
        if n[j] <= 0 or log_evalue(n[j], k[j], max_error) < goal:
            break
        found = j
    return found


DRIFTS = (1.5, 2.0, 3.0, 5.0)
"""The disagreement rates, as multiples of `max_error`, the drift detector's e-CUSUMs are tuned to."""


def _detector_logs(a: float) -> tuple[tuple[float, float], ...]:
    """Per e-CUSUM of the detector, the log factors of a row with `Z = 0` and with `Z = 1`: the Kelly
    bet `g = (r' - a) / (a (1 - a))` against a rate `r'` in `DRIFTS` (below 1)."""
    out = []
    for m in DRIFTS:
        r = min(m * a, (1.0 + a) / 2.0)
        g = (r - a) / (a * (1.0 - a))
        out.append((math.log1p(-g * a), math.log1p(g * (1.0 - a))))
    return tuple(out)


# -- what a decision was set -----------------------------------------------------------------


def live_gated(gate: GatePolicy) -> bool:
    """Whether live certification moves this question's gate: it has an entropy threshold and reads
    once (no re-reads: which reads a decision gets must not depend on the threshold)."""
    return gate.max_normalized_entropy is not None and gate.rereads == 0


@runtime_checkable
class Labeller(Protocol):
    """Who labels audited answers: the escalation target (built in), or people (the review lane:
    `canvasroute.harness.AuditInbox`)."""

    name: str
    """Whose labels these are, in the certificate's words (`reviewers` for people)."""

    async def label(self, asked: Asked) -> Mapping[str, str | None]:
        """An option per question of `asked` (None: declined, counted as a disagreement). A
        transport fault raises (`EscalationError`: the audit is dropped, not counted)."""
        ...


class _TargetLabeller:
    """The escalation target as a labeller: asked as an escalation asks, blind (no canvas hint)."""

    def __init__(self, escalation: Any) -> None:
        self.escalation = escalation
        self.name = target_name(escalation.target)

    async def label(self, asked: Asked) -> Mapping[str, str | None]:
        """The target's answers; through the escalation's breaker like any call to it (an open
        breaker raises `BreakerOpen`, and the audit is dropped: a dead target is not asked)."""
        ids = [s.id for s in asked.specs]
        breaker = self.escalation.breaker_state
        probe = breaker.admit(ids) if breaker is not None else False
        calls = Calls()
        with watched(breaker, probe), tm.escalation_call(self.escalation.target, self.name, ids, audit=True,
                                                         calls=calls) as call:
            result = await escalate(self.escalation, asked, calls)
            call.usage(result.usage.get("input_tokens", 0), result.usage.get("output_tokens", 0))
            call.output({**result.answers, **dict.fromkeys(result.refused)}, result.response_model)
        return {qid: result.answers.get(qid) for qid in ids}


# -- the state -------------------------------------------------------------------------------


class _Question:
    """One question's rows in this worker: counts per candidate in the current epoch."""

    __slots__ = ("alarms", "audits", "bound", "certified", "detector", "epoch", "k", "n", "ok", "on", "other_audits",
                 "suspect", "warned")

    def __init__(self, size: int) -> None:
        self.epoch = 1
        self.n = [0] * size
        """This worker's rows per candidate (this epoch)."""
        self.k = [0] * size
        """... and their disagreements."""
        self.on = [0] * size
        """The other workers' rows per candidate of this epoch, as last read."""
        self.ok = [0] * size
        self.detector = [[0.0] * len(DRIFTS) for _ in range(size)]
        """Per candidate, log D of each e-CUSUM of its drift detector (the certified one's can fire)."""
        self.certified = -1
        self.bound: float | None = 1.0
        """The bound at the certified candidate (or the strictest); None: not worked out since the counts moved."""
        self.audits = 0
        """Audits this worker sent for the question (all epochs)."""
        self.other_audits = 0
        self.alarms = 0
        """Drift alarms this worker raised."""
        self.warned = False
        """Whether this worker said that no row reaches the strictest candidate."""
        self.suspect = False
        """The certified candidate's drift detector is half-way to an alarm: audits come faster (`BOOST`)."""


@dataclass(slots=True, eq=False)
class _Entry:
    """One sampled decision's rows, waiting for its audit (if any) before it counts, in order."""

    rows: dict[str, tuple[float, bool]] = field(default_factory=dict)
    done: bool = False


class Ticket:
    """A sampled decision's audit slot (`Audit.max_pending`), reserved before it is read: consumed
    by its audit, or released at its end."""

    __slots__ = ("_state", "held")

    def __init__(self, state: InMemoryLiveState) -> None:
        self._state = state
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._state._free_slot()


class InMemoryLiveState:
    """Live certification's rows and tests in this process (thread-safe): one per model's `Audit`.

    Example:
        ```python
        state = InMemoryLiveState(Audit(rate=0.05))
        Escalation(target, audit=state.audit, audit_state=state)
        ...
        await state.drain()          # wait for the audits in flight (tests, a bench, a shutdown)
        state.snapshot()["questions"]["team"]["threshold"]
        ```
    """

    def __init__(self, audit: Audit) -> None:
        if not isinstance(audit, Audit):
            raise TypeError(f"audit must be an Audit, not {type(audit).__name__}")
        self.audit = audit
        self._questions: OrderedDict[str, _Question] = OrderedDict()
        self._queue: deque[_Entry] = deque()
        self._pending = 0
        """Audit slots reserved or in flight."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random(audit.seed)
        self._lock = threading.RLock()
        self._detector = _detector_logs(audit.max_error)
        self._alarm = math.log(audit.alarm)
        self.counts = {"decisions": 0, "sampled": 0, "audits": 0, "free": 0, "rows": 0, "disagreements": 0,
                       "declined": 0, "dropped_slots": 0, "dropped_budget": 0, "failed": 0, "alarms": 0}
        """This worker's totals: decisions observed, sampled ones, audits sent, free rows, rows counted,
        their disagreements, labels declined (counted as disagreements), decisions dropped because every
        slot was taken or the budget refused, audits whose labeller failed (dropped), drift alarms."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.audit!r})"

    # -- what a decision is set (no I/O) ---------------------------------------------------

    def view(self, questions: Iterable[str], labeller: str) -> dict[str, tuple[int, int, LiveFigures]]:
        """Per question: its certified candidate (-1: none), its epoch and its figures as held now."""
        out = {}
        with self._lock:
            for qid in questions:
                q = self._questions.get(qid)
                if q is None:
                    out[qid] = (-1, 1, LiveFigures(labeller=labeller, bound=1.0, rows=0, audits=0))
                    continue
                at = max(q.certified, 0)
                out[qid] = (q.certified, q.epoch, LiveFigures(labeller=labeller, bound=self._bound(q),
                                                              rows=q.n[at] + q.on[at], audits=q.audits + q.other_audits,
                                                              epoch=q.epoch))
        return out

    def draw(self, settings: Mapping[str, LiveSetting]) -> tuple[dict[str, LiveSetting], Ticket | None]:
        """The decision's coin: each question sampled with its rate, from one uniform draw; a slot
        reserved when a sampled question may need an audit (none free: those are not sampled)."""
        with self._lock:
            u = self._rng.random()
            self.counts["decisions"] += 1
            drawn = {qid: replace(s, sampled=u < s.rate) for qid, s in settings.items()}
            needs = [qid for qid, s in drawn.items() if s.sampled and not s.free]
            ticket = None
            if needs:
                if self._pending < self.audit.max_pending:
                    self._pending += 1
                    ticket = Ticket(self)
                else:  # decided before the decision is read: the sample stays unbiased
                    self.counts["dropped_slots"] += 1
                    drawn.update({qid: replace(drawn[qid], sampled=False) for qid in needs})
            if any(s.sampled for s in drawn.values()):
                self.counts["sampled"] += 1
            return drawn, ticket

    def _free_slot(self) -> None:
        with self._lock:
            self._pending -= 1

    # -- rows ------------------------------------------------------------------------------

    def enqueue(self, rows: dict[str, tuple[float, bool]], *, done: bool) -> _Entry:
        """A sampled decision's rows, in order (`done=False`: waiting for its audit)."""
        entry = _Entry(rows, done)
        with self._lock:
            self._queue.append(entry)
            self._flush()
        return entry

    def resolve(self, entry: _Entry, rows: Mapping[str, tuple[float, bool]] | None) -> None:
        """An audit's rows are in (`rows` None: dropped, with every row of its decision)."""
        with self._lock:
            if rows is None:
                entry.rows.clear()
            else:
                entry.rows.update(rows)
            entry.done = True
            self._flush()

    def dropped(self, reason: str) -> None:
        """Count a sampled decision left out (`slots`, `budget`) or an audit whose labeller failed (`failed`)."""
        self.count("failed" if reason == "failed" else f"dropped_{reason}")

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def sent(self, questions: Sequence[str]) -> None:
        """Count one audit of `questions`."""
        with self._lock:
            for qid in questions:
                self._question(qid).audits += 1
            self.counts["audits"] += len(questions)

    def _flush(self) -> None:
        """Count the rows of every finished entry at the head of the queue (the caller holds the lock)."""
        queue = self._queue
        while queue and queue[0].done:
            for qid, (score, z) in queue.popleft().rows.items():
                self._row(qid, score, z)

    def _row(self, qid: str, score: float, z: bool) -> None:
        audit, q = self.audit, self._question(qid)
        self.counts["rows"] += 1
        self.counts["disagreements"] += z
        first = bisect.bisect_left(audit.thresholds, score)
        for j in range(first, len(audit.thresholds)):
            q.n[j] += 1
            q.k[j] += z
            self._feed(q, j, 1, int(z))
        self._recompute(q)
        self._check(q)

    def _feed(self, q: _Question, j: int, n: int, k: int) -> None:
        """Feed candidate j's drift detector `n` rows, `k` of them disagreements (a batch: no restart within)."""
        q.detector[j] = [max(d, 0.0) + (n - k) * down + k * up
                         for d, (down, up) in zip(q.detector[j], self._detector, strict=True)]

    def _check(self, q: _Question) -> None:
        """Reset the question when the drift detector of its certified candidate fired (suspect it when
        the detector is half-way there)."""
        c = q.certified
        q.suspect = False
        if c < 0:
            return
        found = q.detector[c]
        top = max(found)
        level = top + math.log(math.fsum(math.exp(d - top) for d in found) / len(found))
        q.suspect = level >= self._alarm / 2
        if level < self._alarm:
            return
        self._reset(q, q.epoch + 1)
        q.alarms += 1
        self.counts["alarms"] += 1
        logger.warning("live certification: drift alarm at H/lnK <= %g (epoch %d): the gate passes nothing until "
                       "new rows certify a threshold", self.audit.thresholds[c], q.epoch - 1)
        self._alarmed()

    def _alarmed(self) -> None:
        """A drift alarm was raised here (a shared state writes it at once)."""

    def _reset(self, q: _Question, epoch: int) -> None:
        size = len(self.audit.thresholds)
        q.epoch, q.n, q.k, q.on, q.ok = epoch, [0] * size, [0] * size, [0] * size, [0] * size
        q.detector = [[0.0] * len(DRIFTS) for _ in range(size)]
        q.certified, q.bound, q.suspect = -1, None, False

    def _recompute(self, q: _Question) -> None:
        """The certified candidate from the pooled counts (its bound worked out when asked)."""
        audit = self.audit
        delta = epoch_delta(audit.delta, q.epoch)
        n = [a + b for a, b in zip(q.n, q.on, strict=True)]
        k = [a + b for a, b in zip(q.k, q.ok, strict=True)]
        q.certified = certified_index(n, k, audit.max_error, delta)
        q.bound = None
        if n[0] == 0 and n[-1] >= STALLED and not q.warned:
            q.warned = True
            logger.warning("live certification: %d rows, none at or below the strictest candidate H/lnK <= %g: the "
                           "test starts there, so nothing can be certified; give Audit(thresholds=...) a grid that "
                           "starts where the traffic is", n[-1], audit.thresholds[0])

    def _bound(self, q: _Question) -> float:
        """The question's bound now: at its certified candidate, or the strictest (the caller holds the lock)."""
        if q.bound is None:
            at = max(q.certified, 0)
            q.bound = upper_bound(q.n[at] + q.on[at], q.k[at] + q.ok[at], epoch_delta(self.audit.delta, q.epoch))
        return q.bound

    def rate(self, qid: str, free: bool) -> float:
        """The chance a decision's coin samples the question now: 1 while nothing is certified and its
        labels come free (`free`: the target labels and uncertain answers escalate to it), `Audit.rate`
        times `BOOST` (at most 1) while its certified candidate's detector is half-way to an alarm, else
        `Audit.rate`. It depends on the past only, so the sampled rows stay a sample of the traffic."""
        with self._lock:
            q = self._questions.get(qid)
            if q is None or q.certified < 0:
                return 1.0 if free else self.audit.rate
            return min(1.0, self.audit.rate * BOOST) if q.suspect else self.audit.rate

    def certified(self, qid: str) -> tuple[int, int]:
        """A question's certified candidate (-1: none) and epoch, as held now."""
        with self._lock:
            q = self._questions.get(qid)
            return (q.certified, q.epoch) if q is not None else (-1, 1)

    def _question(self, qid: str) -> _Question:
        found = self._questions
        q = found.get(qid)
        if q is None:
            q = found[qid] = _Question(len(self.audit.thresholds))
            while len(found) > KEEP:
                found.popitem(last=False)
        else:
            found.move_to_end(qid)
        return q

    # -- shared states --------------------------------------------------------------------------

    def mine(self) -> dict[str, dict[str, Any]]:
        """This worker's rows as a shared state writes them: per question, its epoch, its counts per
        candidate (this epoch) and the audits it sent."""
        with self._lock:
            return {qid: {"epoch": q.epoch, "n": list(q.n), "k": list(q.k), "audits": q.audits}
                    for qid, q in self._questions.items()}

    def merge(self, others: Iterable[Mapping[str, Any]]) -> None:
        """The other workers' rows as last read (each one's `mine`), in place of those read before: per
        question a later epoch is adopted (this worker's counts start again from zero), the counts of
        the current epoch pooled, the detector fed what is new at its candidate."""
        size = len(self.audit.thresholds)
        pooled: dict[str, list[Mapping[str, Any]]] = {}
        for item in others:
            for qid, value in item.items():
                if isinstance(value, Mapping):
                    pooled.setdefault(qid, []).append(value)
        with self._lock:
            for qid in {*pooled, *self._questions}:
                q = self._question(qid)
                values = pooled.get(qid, [])
                top = max([q.epoch, *(int(v.get("epoch", 1)) for v in values)])
                if top > q.epoch:
                    self._reset(q, top)  # another worker's alarm: its new epoch starts here too
                same = [v for v in values if int(v.get("epoch", 1)) == top]
                on = [sum(int(v["n"][j]) for v in same if len(v.get("n", ())) == size) for j in range(size)]
                ok = [sum(int(v["k"][j]) for v in same if len(v.get("k", ())) == size) for j in range(size)]
                q.other_audits = sum(int(v.get("audits", 0)) for v in values)
                for j in range(size):
                    if (new := on[j] - q.on[j]) > 0 and (wrong := ok[j] - q.ok[j]) >= 0:
                        self._feed(q, j, new, wrong)  # the other workers' new rows, as one batch
                q.on, q.ok = on, ok
                self._recompute(q)
                self._check(q)

    # -- shared states override these --------------------------------------------------------

    async def refresh(self) -> None:
        """Bring the other workers' rows in when due (a state in one process: nothing to do)."""
        return None

    async def decided(self) -> None:
        """A decision ended (a shared state writes this worker's rows when due)."""
        return None

    # -- background audits -------------------------------------------------------------------

    def spawn(self, work: Coroutine[Any, Any, None], abandon: Callable[[], None]) -> None:
        """Run an audit in the background of the running loop (`drain` waits for it, `aclose` cancels
        it); `abandon` settles it when it is cancelled before it ever ran."""
        task = asyncio.get_running_loop().create_task(work)
        with self._lock:
            self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, abandon))

    def _done(self, task: asyncio.Task[None], abandon: Callable[[], None]) -> None:
        with self._lock:
            self._tasks.discard(task)
        if task.cancelled():
            abandon()

    def _running(self) -> list[asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        with self._lock:
            return [t for t in self._tasks if t.get_loop() is loop]

    async def drain(self) -> None:
        """Wait until every audit this loop started has ended (and its rows are counted)."""
        while tasks := self._running():
            await asyncio.wait(tasks)

    async def aclose(self) -> None:
        """Cancel the audits this loop started (their decisions' rows are dropped) and wait for them."""
        tasks = self._running()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def snapshot(self) -> dict[str, Any]:
        """For dashboards and `/metrics`: the claim (`max_error`, `confidence`, `rate`), this worker's
        `counts`, `pending` audits, and per question its certified `threshold` (None: passes nothing),
        `bound`, `rows` (pooled, at the certified candidate or the strictest), `audits` (every
        worker's), `epoch` and `alarms` (this worker's)."""
        audit = self.audit
        with self._lock:
            questions = {}
            for qid, q in self._questions.items():
                at = max(q.certified, 0)
                questions[qid] = {"threshold": audit.thresholds[q.certified] if q.certified >= 0 else None,
                                  "bound": self._bound(q), "rows": q.n[at] + q.on[at],
                                  "audits": q.audits + q.other_audits,
                                  "epoch": q.epoch, "alarms": q.alarms}
            return {"max_error": audit.max_error, "confidence": audit.confidence, "rate": audit.rate,
                    "labels": audit.labels, "counts": dict(self.counts), "pending": self._pending,
                    "questions": questions}


# -- a decision's start and end ------------------------------------------------------------


def _labeller_name(request: DecisionRequest) -> str:
    escalation = request.escalation
    assert escalation is not None and escalation.audit is not None
    reviewer = escalation.audit.reviewer
    return str(getattr(reviewer, "name", "reviewers")) if reviewer is not None else target_name(escalation.target)


def live_steered(request: DecisionRequest, pinned: Mapping[str, tuple[int, int]] | None = None) -> DecisionRequest:
    """`request` with each live question's gate at its certified threshold (with a live `Certificate`),
    or passing nothing (an uncertified one) while none is certified; once (a request already set is
    returned as it is). `pinned`: the (candidate, epoch) to apply instead, by question (a node cache key's)."""
    escalation = request.escalation
    if (escalation is None or escalation.audit is None or escalation.audit_state is None
            or request.live is not None or request.mode == "canvas_only"):
        return request
    audit: Audit = escalation.audit
    state: InMemoryLiveState = escalation.audit_state
    gates = request.gates
    ids = [qid for qid, g in gates.items() if live_gated(g)]
    if not ids:
        return replace(request, live={})
    views = state.view(ids, _labeller_name(request))
    free = audit.labels == "target" and request.outcomes.uncertain == "escalate"
    settings: dict[str, LiveSetting] = {}
    changed: dict[str, GatePolicy] = {}
    for qid in ids:
        index, epoch, figures = views[qid]
        if pinned is not None and qid in pinned:
            index, epoch = pinned[qid]
        threshold = audit.thresholds[index] if index >= 0 else None
        cert = Certificate(max_error=audit.max_error, confidence=audit.confidence, rows=0, escalation_rate=0.0,
                           certified=index >= 0, method=METHOD, live=figures)
        settings[qid] = LiveSetting(threshold, index, epoch, 1.0 if index < 0 and free else state.rate(qid, False),
                                    index < 0 and free)
        changed[qid] = replace(gates[qid], per_question={}, certificate=cert,
                               max_normalized_entropy=threshold if threshold is not None else audit.thresholds[0])
    gate = replace(request.gate, per_question={**request.gate.per_question, **changed})
    return replace(request, gate=gate, gates={**gates, **changed}, live=settings)


async def steer(request: DecisionRequest) -> tuple[DecisionRequest, Ticket | None, Exception | None]:
    """The start of a decision under an audit: the state refreshed (a shared one reads the others'
    rows when due), the live gates set (`live_steered`), the coin drawn and a slot reserved; and the
    fault that kept a shared state from refreshing (None: none; the decision goes on with the rows
    as last read, logged here and marked and counted by `observe`)."""
    escalation = request.escalation
    assert escalation is not None and escalation.audit_state is not None
    state: InMemoryLiveState = escalation.audit_state
    fault = None
    try:
        await state.refresh()
    except Exception as exc:  # noqa: BLE001 - stale rows steer; the fault is logged, marked and counted
        fault = exc
        logger.warning("live certification could not read the other workers' rows (gating with the last read): "
                       "%s: %s", type(exc).__name__, exc)
    request = live_steered(request)
    if not request.live:
        return request, None, fault
    drawn, ticket = state.draw(request.live)
    return replace(request, live=drawn), ticket, fault


def _canvas_answer(report: ReadReport, options: Sequence[str]) -> str | None:
    """The canvas's best real option (the answer the gate passed or would have passed)."""
    canvas = report.canvas_probabilities
    if not canvas:
        return None
    return max(options, key=lambda o: canvas.get(o, 0.0))


async def observe(request: DecisionRequest, reports: Sequence[ReadReport], span: Any, ticket: Ticket | None,
                  fault: Exception | None = None) -> None:
    """The end of a decision under an audit: its sampled questions' rows (free labels now, audits in
    the background), once; never failing the decision. `fault`: a refresh that failed at its start."""
    escalation = request.escalation
    assert escalation is not None and escalation.audit is not None
    audit: Audit = escalation.audit
    state: InMemoryLiveState = escalation.audit_state
    if fault is not None:
        tm.record_audit_fault(span, fault)
    settings = request.live or {}
    specs = request.questions.specs
    rows: dict[str, tuple[float, bool]] = {}
    ask: dict[str, tuple[float, str]] = {}
    lost = False
    for r in reports:
        s = settings.get(r.question_id)
        if s is None or not s.sampled or r.error is not None or r.normalized_entropy is None or r.cause == "abstained":
            continue
        if not set(r.crossed) <= {"max_normalized_entropy", "uncertified"}:
            continue  # another threshold stopped it: no candidate would pass it
        if r.cause == "over_budget":
            lost = True  # its label was lost to the budget: the decision's rows go with it
            break
        canvas = _canvas_answer(r, specs[r.question_id].answer_options)
        if canvas is None:
            continue
        score = float(r.normalized_entropy)
        if not r.confident and audit.labels == "target" and r.path == "escalated":
            rows[r.question_id] = (score, r.answer != canvas)
        elif not r.confident and audit.labels == "target" and r.refusal is not None:
            rows[r.question_id] = (score, True)  # the labeller declined it
        else:
            ask[r.question_id] = (score, canvas)
    try:
        if lost:
            state.dropped("budget")
            return
        if not ask:
            if rows:
                state.count("free", len(rows))
                state.enqueue(rows, done=True)
            return
        if ticket is None:  # (no slot was reserved when it was drawn: audits stay bounded, this one is dropped)
            state.dropped("slots")
            return
        meter, thread = escalation.meter, request.identity.thread_id
        if audit.labels == "target" and meter is not None:
            try:
                granted = await meter.take(len(ask), thread)
            except Exception as exc:  # noqa: BLE001 - an audit is optional: a meter fault drops it (logged, counted)
                logger.warning("live certification: the escalation budget could not be taken for an audit (%s: %s); "
                               "dropped", type(exc).__name__, exc)
                granted = 0
            if granted < len(ask):
                if granted:
                    await meter.refund(granted, thread)
                state.dropped("budget")
                tm.record_audit(span, "dropped", list(ask))
                return
        if rows:
            state.count("free", len(rows))
        entry = state.enqueue(rows, done=False)
        state.sent(list(ask))
        tm.record_audit(span, "sent", list(ask))
        job = _Audit(request, state, entry, ask, {r.question_id: r.answer for r in reports}, ticket)
        ticket = None  # the audit holds the slot now
        state.spawn(job.run(), job.abandon)
    finally:
        if ticket is not None:
            ticket.release()
        try:
            await state.decided()
        except Exception as exc:  # noqa: BLE001 - the answers stand; the fault is logged, marked and counted
            logger.warning("live certification could not record its rows (%s): %s",
                           type(exc).__name__, exc)
            tm.record_audit_fault(span, exc)


def _asked(request: DecisionRequest, ids: Sequence[str], answers: Mapping[str, str | None]) -> Asked:
    """What an audit asks: the decision as an escalation would (the parents' final answers restated),
    blind: without the canvas's distribution."""
    deps, specs = request.questions.depends, request.questions.specs
    parents = {qid: tuple(Restated(t, a) for t, a in deps.parents_of(qid, answers, specs)) for qid in ids}
    return Asked(specs=tuple(_plain(specs[q]) for q in ids), state=request.state.value, text=request.state.text,
                 restated=deps.restatement(ids, answers, specs), parents={q: p for q, p in parents.items() if p},
                 instructions=request.read.instructions, images=request.state.images, canvas={})


def _plain(spec: QuestionSpec) -> QuestionSpec:
    """The question as asked by the caller (no abstain label)."""
    return replace(spec, options=spec.answer_options, abstain=False) if spec.abstain else spec


@dataclass(slots=True, eq=False)
class _Audit:
    """One audit in the background: the labeller asked, its rows counted in order (or dropped), settled once."""

    request: DecisionRequest
    state: InMemoryLiveState
    entry: _Entry
    ask: Mapping[str, tuple[float, str]]
    """Per question asked: its score and the canvas answer."""
    answers: Mapping[str, str | None]
    """The decision's final answers (a dependent question's parents are restated)."""
    ticket: Ticket | None
    settled: bool = False

    async def run(self) -> None:
        request, state, ask = self.request, self.state, self.ask
        escalation = request.escalation
        assert escalation is not None and escalation.audit is not None
        audit: Audit = escalation.audit
        labeller: Labeller = audit.reviewer if audit.labels == "review" else _TargetLabeller(escalation)
        timeout = audit.timeout or (escalation.timeout if audit.labels == "target" else REVIEW_TIMEOUT)
        ids = list(ask)
        rows: dict[str, tuple[float, bool]] | None = None
        try:
            try:
                labels = await asyncio.wait_for(labeller.label(_asked(request, ids, self.answers)), timeout)
            except TimeoutError:
                if audit.labels == "target":
                    raise EscalationError(f"audit by {labeller.name} timed out after {timeout}s",
                                          failure="network", retryable=True) from None
                labels = {}  # nobody answered in time: a disagreement
            rows = {}
            for qid, (score, canvas) in ask.items():
                label = labels.get(qid)
                if label is None:
                    state.count("declined")
                rows[qid] = (score, label is None or label != canvas)
            tm.record_audit(None, "labelled", ids)
        except EscalationError as exc:
            if exc.failure == "format":  # a reply outside the options: the labeller's, for this item
                rows = {qid: (score, True) for qid, (score, _) in ask.items()}
                state.count("declined", len(ask))
                tm.record_audit(None, "labelled", ids)
            else:
                logger.warning("live certification: audit of %s by %s failed (dropped, not counted): %s",
                               ", ".join(ids), labeller.name, exc)
                tm.record_audit(None, "failed", ids)
        except asyncio.CancelledError:
            await self._settle(None)
            raise
        except Exception as exc:  # noqa: BLE001 - a labeller's own fault: logged, counted, the audit dropped
            logger.warning("live certification: audit of %s by %s raised (dropped, not counted): %s: %s",
                           ", ".join(ids), labeller.name, type(exc).__name__, exc)
            tm.record_audit(None, "failed", ids)
        await self._settle(rows)

    async def _settle(self, rows: dict[str, tuple[float, bool]] | None) -> None:
        """Count the rows (None: dropped: counted as failed, its budget grant given back), once."""
        if self.settled:
            return
        self._close(rows)
        escalation = self.request.escalation
        assert escalation is not None and escalation.audit is not None
        meter = escalation.meter
        if rows is None and escalation.audit.labels == "target" and meter is not None:
            await asyncio.shield(meter.refund(len(self.ask), self.request.identity.thread_id))  # nothing labelled

    def _close(self, rows: dict[str, tuple[float, bool]] | None) -> None:
        self.settled = True
        if rows is None:
            self.state.dropped("failed")
        self.state.resolve(self.entry, rows)
        if self.ticket is not None:
            self.ticket.release()

    def abandon(self) -> None:
        """Settle an audit cancelled before it ran (as `aclose` does at shutdown): dropped; its budget
        grant is given back when the loop still runs."""
        if self.settled:
            return
        self._close(None)
        escalation = self.request.escalation
        meter = escalation.meter if escalation is not None else None
        if meter is not None and escalation is not None and escalation.audit is not None \
                and escalation.audit.labels == "target":
            with contextlib.suppress(RuntimeError):  # no loop left: nothing to give back to
                asyncio.get_running_loop().create_task(meter.refund(len(self.ask), self.request.identity.thread_id))
