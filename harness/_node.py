"""`decision_node`: a LangGraph node that answers its questions with one canvas read.

The node is a `Runnable` with a native async path (`ainvoke`, so parallel branches read
concurrently and `TimeoutPolicy` applies) and a sync path (`invoke`, so `graph.invoke`
works). It returns `Command(goto=..., update={output_key: ...})`, so the decision is
written into state, checkpointed, cached and retried with the node. Each run builds one
`DecisionRequest` (`GraphCall.request`) and hands it whole to the read, the review, the
shadow, the records and the event.

How the drawing learns the targets: LangGraph's public ways are a node's
`Command[Literal[...]]` return annotation (read from `__call__` by `add_node`) and
`add_node(..., destinations=...)`. A node cannot reach `add_node`'s arguments, so each
`DecisionNode` gets its own bound `__call__` annotated with exactly its destinations.

Fan-out (`Send`): every branch asks the same question ids, so a branch's records are
grouped under its key, `{question_id: {branch: record}}`, which `merge_decisions` merges:
the key is `branch(state)` (or `state[branch]`) when the node has `branch=`; otherwise, for a
node run by a `Send`, the Send's position among the step's Sends (`"0"`, `"1"`, ...); a node
run by an ordinary edge writes flat records. Two branches of one superstep with the same
key would overwrite each other: the second raises `DecisionError` instead.

Retries (`retry_on`): inside a graph one layer retries a fault, never two (their attempts
would multiply). A canvas read's transient faults belong to the engine (`VLLMServerEngine`
retries each request itself, and the error that leaves it carries its `attempts`), so
`retry_on` retries only a transient canvasroute fault no lower layer has retried
(`attempts == 1`). LangGraph's default predicate retries any exception it does not list, a
malformed engine answer or a spent budget included: `retry_on` decides every canvasroute
error by its `retryable` flag and leaves other exceptions to LangGraph's default.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any, Literal

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import (
    ensure_config,
    get_async_callback_manager_for_config,
    get_callback_manager_for_config,
)
from langgraph.errors import GraphInterrupt
from langgraph.types import CachePolicy, Command, RetryPolicy

from canvasroute.engine import CanvasRouteError, DecisionError
from canvasroute.engine._compat import moved_keywords, renaming
from canvasroute.router import CanvasDecisionModel, CanvasResponse, DecisionRequest, ReadOptions, Totals, read_options
from canvasroute.router._audit import live_steered
from canvasroute.router._control import steered
from canvasroute.router._request import schema_decision

from ._context import (
    GraphCall,
    Inputs,
    check_review,
    child_config,
    graph_call,
    graph_value,
    select_inputs,
    state_lacks,
    warn_dropped,
)
from ._records import DECISION_EVENT, REVIEW_EVENT, aemit, emit, entries, event, is_record, trace_route
from ._review import (
    Checkpointed,
    ReviewPolicy,
    adurable,
    check_parents_unreviewed,
    durable,
    pending_review,
    review,
    review_for,
)
from ._shadow import ExistingRouter, Shadow, ShadowOutcome

Questions = Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]
"""Static `{question_id: Noul | Choice | Score}`, or a function of the graph state."""
Decisions = dict[str, dict[str, Any]]
"""The node's records by question id, as a route function receives them."""
Route = (tuple[str, Mapping[Any, str]] | Callable[[Decisions], str] | Callable[[Decisions, Any], str] | None)
"""`(question_id, {option: node})`, a function of the decisions (or of the decisions and the
graph state) returning a node, or None."""
Branch = str | Callable[[Any], Any] | None
"""What names a fan-out branch: a state key, a function of the node's input, or None."""
MAX_HISTORY = 100
"""Records a node keeps per question with `history=` (the bound)."""


_READ_OPTIONS = {"read_options": "read"}
"""0.1's name of `read` (until 0.3.0)."""


class DecisionNode(Runnable[Any, Command[Any]]):
    """A graph node that asks its questions in one canvas read and routes on the answers.

    Build it with `decision_node(...)`; see there for the arguments.
    """

    @moved_keywords(_READ_OPTIONS, renaming("DecisionNode", _READ_OPTIONS))
    def __init__(self, model: CanvasDecisionModel, questions: Questions, *, inputs: Inputs, route: Route,
                 output_key: str, name: str | None, review: ReviewPolicy | None,
                 destinations: Sequence[str] | None, shadow: ExistingRouter | None = None,
                 depends_on: Mapping[str, Any] | None = None, branch: Branch = None,
                 read: ReadOptions | Mapping[str, Any] | None = None, history: int = 0) -> None:
        if not isinstance(model, CanvasDecisionModel):
            raise TypeError(f"model must be a CanvasDecisionModel, not {type(model).__name__}")
        if isinstance(questions, type):  # a schema (GradeDocuments): its fields, its docstring as instructions
            questions, read = schema_decision(questions, read)
        if not (callable(questions) or isinstance(questions, Mapping)):
            raise TypeError("questions must be a mapping of id to question, or a function of the state")
        if not (inputs is None or isinstance(inputs, str) or callable(inputs)):
            raise TypeError("inputs must be None, a state key, or a function of the state")
        if review is not None and not isinstance(review, ReviewPolicy):
            raise TypeError(f"review must be a ReviewPolicy, not {type(review).__name__}")
        if not (branch is None or isinstance(branch, str) or callable(branch)):
            raise TypeError("branch must be None, a state key, or a function of the node's input")
        if not output_key:
            raise ValueError("output_key must be a non-empty state key")
        if isinstance(history, bool) or not isinstance(history, int) or not 0 <= history <= MAX_HISTORY:
            raise ValueError(f"history must be an integer within 0..{MAX_HISTORY} (records kept per question)")
        self.model = model
        self.questions = questions
        self.inputs = inputs
        self.output_key = output_key
        self.review = review
        self.read = read_options(read)
        """How the node's canvases are read."""
        self.history = history
        """Earlier records kept per question (and branch), newest last, under `history` (0: none)."""
        self.route_question, self.route_map, self.route_fn = parse_route(route)
        self._route_takes_state = self.route_fn is not None and _takes_state(self.route_fn)
        self.destinations = route_destinations(self.route_map, self.route_fn, destinations)
        """The nodes this node can go to (what the graph drawing shows)."""
        self.name = name or (f"decide_{self.route_question}" if self.route_question else "decide")
        self.depends_on = dict(depends_on) if depends_on else None
        """`{child: (parent, answers)}`: children asked only when their parent's answer matches."""
        if self.depends_on and self.route_question in self.depends_on:
            raise ValueError(f"route question {self.route_question!r} cannot depend on another question: "
                             "when it is skipped there is no answer to route on")
        if isinstance(questions, Mapping):
            built = self.model.request("", questions, read=read, depends_on=self.depends_on)
            self._check(built)
            if review is not None:  # a parent under review: refused when the node is built
                check_parents_unreviewed(self.name, built.questions.depends.parent_ids, review.questions)
        self.branch = branch
        """What keys a fan-out branch's records (None: a `Send`'s position; no `Send`: flat records)."""
        self._branches = BranchKeys()
        self._schema_checked = False
        self._node_cache = False
        self._pins = Pins()
        if shadow is not None and review is not None:
            raise ValueError("shadow= and review= do not combine: in shadow mode the existing router decides")
        self.shadow = Shadow(shadow, self.destinations) if shadow is not None else None
        """The existing router this node shadows (None: the canvas routes)."""
        if self.destinations:
            self.__call__ = MethodType(annotated_call(self.destinations), self)  # type: ignore[method-assign]

    def __repr__(self) -> str:
        route = self.route_question or ("callable" if self.route_fn else None)
        return f"DecisionNode(name={self.name!r}, route={route!r}, destinations={self.destinations!r})"

    def __call__(self, state: Any, config: RunnableConfig | None = None) -> Command[Any]:
        """Run the node synchronously (what `invoke` does)."""
        return self.invoke(state, config)

    def cache_policy(self, ttl: int | None = None) -> CachePolicy:  # type: ignore[type-arg]
        """A LangGraph `CachePolicy` keyed on this node's decision (`cache_key`).

        `builder.add_node("triage", node, cache_policy=node.cache_policy(ttl=300))` with
        `builder.compile(cache=NodeCache(InMemoryCache()))`: an identical decision about an
        identical decision state is not read again. `NodeCache` (`canvasroute.harness`) keeps
        LangGraph from storing a decision that an engine fault or a budget refusal touched,
        which a plain LangGraph cache would replay for its TTL. A hit's records are replays
        (`timing.replayed == "node_cache"`): they spent nothing in the run that replayed them.

        A hand-built `CachePolicy(key_func=node.cache_key)` is the same node cache: its first key
        does what this does.

        Raises:
            DecisionError: the node keeps `history=`: a hit would replay the records the node
                wrote then, their history included, in place of this run's.
        """
        self._cached()
        return CachePolicy(key_func=self.cache_key, ttl=ttl)

    def _cached(self) -> None:
        """Mark the node as run behind a node cache (refused with `history=`)."""
        if self.history:
            raise DecisionError(f"decision node {self.name!r} keeps history= and a node cache would replay the "
                                "records it wrote when it was cached, their history included",
                                hint="cache the model's decisions instead, CanvasDecisionModel(cache=DecisionCache()): "
                                     "the node still runs, keeps its history and records each hit as a replay")
        self._node_cache = True

    def cache_key(self, state: Any) -> str:
        """The node cache's key for deciding on `state`: a SHA-256 (hex) of the node's name, the
        request it would make (`DecisionRequest.key`: questions, dependencies, read options, the
        decision state as read with its images, gate, outcomes), its model's name and, in a
        fan-out with `branch=`, the branch's key.

        The rest of the graph state does not enter the key, so an unrelated key changing does
        not cause a re-read; the key is the same in every process. LangGraph calls it with the
        node's input only, not its config: a run-scoped `Runtime.context` override
        (`decision_model`, `gate`) is not part of the key, so do not combine a node cache with
        per-run overrides. A hit replays the node's `Command` without running it and emits no
        decide span. With an escalation-rate controller the key holds its thresholds as this
        process holds them (`Pins`), and a miss is decided with those (see `Pins` for concurrent
        runs of one decision).

        Raises:
            DecisionError: the node keeps `history=` (as `cache_policy` does).
        """
        if not self._node_cache:
            self._cached()
        questions = self.questions(state) if callable(self.questions) else self.questions
        decision_state = select_inputs(state, self.inputs, self.output_key)
        request = self.model.request(decision_state, questions, read=self.read, depends_on=self.depends_on)
        branch = branch_key(self.branch, state, {}) if self.branch is not None else None
        if request.escalation is not None and (request.escalation.controller is not None
                                               or request.escalation.audit is not None):
            request = self._pins.pin(request, branch)
        blob = json.dumps([self.name, request.key, self.model.model, branch])
        return hashlib.sha256(blob.encode()).hexdigest()

    # -- Runnable -----------------------------------------------------------------------

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Command[Any]:
        """Decide synchronously (`graph.invoke`): one read for all questions, then route."""
        config = complete(config)
        job = self._prepare(input, config, get_callback_manager_for_config)
        if self.shadow is not None:
            canvas = job.request.canvas_only()
            command, payload = self._finish_shadow(job, *self.shadow.run(
                input, config, lambda: self._read(job, config, canvas), self._canvas_goto(input),
                job.call.attributes, job.call.node))
        elif job.review is None:
            command, payload = self._finish(job, input, self._read(job, config, job.request))
        else:
            done = durable(lambda: self._read(job, config, job.request))
            try:
                human = self._human(job, done.response)
            except GraphInterrupt:  # the run pauses for a human: its review event (once), then the interrupt
                if done.fresh:
                    emit(self._review_event(job, done), config, job.observed)
                raise
            command, payload = self._finish(job, input, done.response, human, done)
        emit(payload, config, job.observed)
        return command

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Command[Any]:
        """Decide asynchronously (`graph.ainvoke`): one read for all questions, then route."""
        config = complete(config)
        job = self._prepare(input, config, get_async_callback_manager_for_config)
        if self.shadow is not None:
            canvas = job.request.canvas_only()
            command, payload = self._finish_shadow(job, *await self.shadow.arun(
                input, config, lambda: self._aread(job, config, canvas), self._canvas_goto(input),
                job.call.attributes, job.call.node))
        elif job.review is None:
            command, payload = self._finish(job, input, await self._aread(job, config, job.request))
        else:
            done = await adurable(lambda: self._aread(job, config, job.request))
            try:
                human = self._human(job, done.response)
            except GraphInterrupt:
                if done.fresh:
                    await aemit(self._review_event(job, done), config, job.observed)
                raise
            command, payload = self._finish(job, input, done.response, human, done)
        await aemit(payload, config, job.observed)
        return command

    # -- the decision -------------------------------------------------------------------

    def _prepare(self, state: Any, config: RunnableConfig, manager_for: Callable[[RunnableConfig], Any]) -> _Job:
        call = graph_call(config, self.model, str(self.name))
        questions = self.questions(state) if callable(self.questions) else self.questions
        if not self._schema_checked:  # once per node, at its first run in a graph
            lacks = state_lacks(config, self.output_key)
            self._schema_checked = lacks is not None
            if lacks:
                warn_dropped(call.node, self.output_key)
        branch = branch_key(self.branch, state, config)
        if branch is not None:
            if self._node_cache and self.branch is None:  # a hit would replay another branch's key
                raise DecisionError(f"decision node {call.node!r} has a node cache and runs in a Send fan-out: "
                                    "its records need a key of the branch's input",
                                    hint="pass decision_node(..., branch=<a key of the branch's input>)")
            self._branches.claim(call.node, call.checkpoint_id, branch, call.task_id)
        decision_state = select_inputs(state, self.inputs, self.output_key)
        request = call.request("node", questions, decision_state, depends_on=self.depends_on, read=self.read,
                               branch=branch)
        if self._node_cache and request.escalation is not None and (request.escalation.controller is not None
                                                                    or request.escalation.audit is not None):
            keyed = request if call.model is self.model else self.model.request(  # a run's model: the key's request
                decision_state, questions, read=self.read, depends_on=self.depends_on)
            request = self._pins.pinned(request, keyed, branch)
        if callable(self.questions):
            self._check(request)
        reviewing = None
        if self.shadow is None and (self.review is not None or request.outcomes.uncertain == "review"):
            reviewing = review_for(self.review, request, call.node)
        if reviewing is not None:
            check_review(config, call.node)  # before any read: an interrupt nobody could resume
        earlier = _earlier(state, self.output_key, config) if self.history else {}
        return _Job(call, request, observed(config, manager_for), reviewing, earlier)

    def _read(self, job: _Job, config: RunnableConfig, request: DecisionRequest) -> CanvasResponse:
        model = job.call.model
        if not job.observed:
            return model.run(request)
        return model.invoke(_invoke_input(request), child_config(config))  # type: ignore[arg-type]

    async def _aread(self, job: _Job, config: RunnableConfig, request: DecisionRequest) -> CanvasResponse:
        model = job.call.model
        if not job.observed:
            return await model.arun(request)
        return await model.ainvoke(_invoke_input(request), child_config(config))  # type: ignore[arg-type]

    def _review_event(self, job: _Job, done: Checkpointed) -> dict[str, Any]:
        """The event of a decision set that pauses for a human: what it proposes, and what the
        run that decided it spent (under the id its records will keep). Sent only by the run that
        decided it (`done.fresh`): a run that pauses again on the checkpointed decision (a resume
        of another fan-out branch, `invoke(None)` on a paused thread) read nothing and sends none."""
        assert job.review is not None
        decided = entries(done.response, {}, done.decision, spent=done.spent)
        return event(REVIEW_EVENT, job.call.node, None, decided, job.request,
                     review=pending_review(job.review, done.response))

    def _human(self, job: _Job, response: CanvasResponse) -> dict[str, str]:
        """The human's options (interrupts the first time; a resume returns them)."""
        assert job.review is not None
        return review(job.review, job.call.node, response, job.request)

    def _finish(self, job: _Job, state: Any, response: CanvasResponse, human: Mapping[str, str] | None = None,
                done: Checkpointed | None = None) -> tuple[Command[Any], dict[str, Any]]:
        """The `Command` and the decision event. A reviewed decision's records carry its own id and
        what the run that decided it spent (`done`); a resume's event says what the resume spent."""
        spent = None
        if done is None:
            decided = entries(response, human or {}, job.call.task_id)
        else:
            decided = entries(response, human or {}, done.decision, spent=done.spent)
            if not done.fresh:  # the resume replayed the checkpoint: it spent nothing, under its own id
                spent = (job.call.task_id or uuid.uuid4().hex, Totals())
        goto = self._goto(decided, state)
        trace_route(job.call.attributes, goto)
        update = {self.output_key: self._written(decided, job.earlier, job.request.identity.branch)}
        command = Command(update=update) if goto is None else Command(goto=goto, update=update)
        return command, event(DECISION_EVENT, job.call.node, goto, decided, job.request, spent=spent)

    def _canvas_goto(self, state: Any) -> Callable[[CanvasResponse], str | None]:
        return lambda response: self._goto(entries(response, {}), state)

    def _finish_shadow(self, job: _Job, response: CanvasResponse | None,
                       outcome: ShadowOutcome) -> tuple[Command[Any], dict[str, Any]]:
        """Go where the existing router said; record what the canvas would have done."""
        decided = entries(response, {}, job.call.task_id) if response is not None else {}
        for qid, record in decided.items():
            record["shadow"] = outcome.record(qid)
        trace_route(job.call.attributes, outcome.destination)
        update = {self.output_key: self._written(decided, job.earlier, job.request.identity.branch)} if decided \
            else None
        return Command(goto=outcome.destination, update=update), event(
            DECISION_EVENT, job.call.node, outcome.destination, decided, job.request, shadow=outcome.record())

    def _written(self, decided: Decisions, earlier: Mapping[str, Any], branch: str | None) -> dict[str, Any]:
        """The records as the node writes them: grouped by branch, each with its question's
        earlier records (`history`, from `earlier`: the records in the graph state), newest last."""
        if self.history:
            for qid, record in decided.items():
                prev = earlier.get(qid)
                if branch is not None:
                    prev = prev.get(branch) if isinstance(prev, Mapping) and not is_record(prev) else None
                kept = []
                if isinstance(prev, Mapping) and is_record(prev):
                    kept = [*prev.get("history", ()), {k: v for k, v in prev.items() if k != "history"}]
                record["history"] = kept[-self.history:]  # present from the first run: empty then
        return grouped(decided, branch)

    def _goto(self, decided: Decisions, state: Any) -> str | None:
        if self.route_fn is not None:
            goto = self.route_fn(decided, state) if self._route_takes_state else self.route_fn(decided)
            if goto not in self.destinations:
                raise ValueError(f"{self.name}: route returned {goto!r}, which is not one of the declared "
                                 f"destinations {list(self.destinations)}")
            return goto
        if self.route_map is not None:
            assert self.route_question is not None
            return self.route_map[decided[self.route_question]["answer"]]
        return None

    def _check(self, request: DecisionRequest) -> None:
        """The routing question exists and every one of its options has a node."""
        if self.route_map is None:
            return
        qid, specs = self.route_question, request.questions.specs
        assert qid is not None  # a route map has its question
        if qid not in specs:
            raise ValueError(f"route question {qid!r} is not among the questions {list(specs)}")
        check_path_map(qid, specs[qid].options, self.route_map, "route")


@dataclass(slots=True)
class _Job:
    """One node run between preparing the request and building the `Command`."""

    call: GraphCall
    request: DecisionRequest
    observed: bool
    """A callback handler would see the model's run (else `arun` is called directly)."""
    review: ReviewPolicy | None
    """What goes to a human in this run (`review_for`; None: nothing)."""
    earlier: Mapping[str, Any]
    """The records in the graph state before this run (read only with `history=`)."""


PinKey = tuple[str, str, str, str, str | None]


def pin_key(request: DecisionRequest, branch: str | None) -> PinKey:
    """What a request decides on, of the parts of its `key` that a graph run's request shares with
    the one `cache_key` makes of the same model (not the gate layer, the seed of the site, the
    budget meter or controller state): for one model, two requests with the same pin key have the
    same `cache_key` request."""
    qset = request.questions
    return qset.key, qset.depends.key(), request.read.key(), request.state.digest, branch


class Pins:
    """The thresholds a node cache key was computed with, by what the key's request decides on
    (`pin_key`: questions, dependencies, read options, state; and branch): the escalation-rate
    controller's, and live certification's certified candidates (`Escalation.audit`), so the run a
    miss brings decides with those: LangGraph computes the key before it runs the node, and another
    decision may move them in between. One pin per decision: when a second key of the same decision
    (and branch) is computed before the first key's run reads its pin (concurrent runs of one
    decision), both runs decide with the later key's thresholds, and the first key's cache entry
    holds a decision made with them. Bounded (`KEEP`); the states are the ones the node last ran
    with (a graph store's); an evicted pin's run steers itself."""

    KEEP = 1024

    def __init__(self) -> None:
        self._pins: OrderedDict[PinKey, tuple[dict[str, float], dict[str, tuple[int, int]]]] = OrderedDict()
        self._lock = threading.Lock()
        self.state: Any = None
        """The controller state of the node's last run (None: the model's own)."""
        self.live: Any = None
        """The live certification state of the node's last run (None: the model's own)."""

    def pin(self, request: DecisionRequest, branch: str | None) -> DecisionRequest:
        """`request` with its live and controlled thresholds as they stand now, kept for its run."""
        steered_ = steered(live_steered(request.audited_by(self.live)).controlled_by(self.state))
        key = pin_key(request, branch)
        with self._lock:
            self._pins[key] = ({qid: s.threshold for qid, s in (steered_.controlled or {}).items()},
                               {qid: (s.index, s.epoch) for qid, s in (steered_.live or {}).items()})
            self._pins.move_to_end(key)
            while len(self._pins) > self.KEEP:
                self._pins.popitem(last=False)
        return steered_

    def pinned(self, request: DecisionRequest, keyed: DecisionRequest, branch: str | None) -> DecisionRequest:
        """`request` (the run's) set to the thresholds its cache key named (`keyed`: a request
        deciding on what `cache_key`'s request did, the run's own when the run has the node's
        model), or left to set itself when no key was computed for it."""
        assert request.escalation is not None
        self.state, self.live = request.escalation.controller_state, request.escalation.audit_state
        key = pin_key(keyed, branch)
        with self._lock:
            pin = self._pins.get(key)
        if pin is None:
            return request
        thresholds, lives = pin
        return steered(live_steered(request, lives), thresholds)


def complete(config: RunnableConfig | None) -> RunnableConfig:
    """A graph step's config as it comes (it carries the run's callbacks); anything else,
    `None` included, completed from the current runnable context by `ensure_config`."""
    return config if config is not None and "callbacks" in config else ensure_config(config)


def observed(config: RunnableConfig, manager_for: Callable[[RunnableConfig], Any]) -> bool:
    """Whether a callback handler (LangSmith tracer, OpenInference instrumentor, stream or
    debug handler) would see the model's child run. When none would, the node calls
    `adecide` directly instead of through langchain-core's Runnable run machinery, which
    only those handlers read, and sends no custom callback events.

    In a graph step the config holds the run's child manager, which already carries every
    inheritable handler its run was configured with (environment tracing, hooks, debug), so
    its own lists answer; anywhere else the manager is configured in full (`manager_for`).
    """
    callbacks = config.get("callbacks")
    if not (isinstance(callbacks, BaseCallbackManager) and callbacks.parent_run_id is not None):
        callbacks = manager_for(config)
    return bool(callbacks.handlers or callbacks.inheritable_handlers)


def _invoke_input(request: DecisionRequest) -> dict[str, Any]:
    """What `invoke` takes for a prebuilt request (callback tracers see state and questions)."""
    return {"state": request.state.value, "questions": request.questions.asked, "request": request}


def _earlier(state: Any, key: str, config: RunnableConfig) -> Mapping[str, Any]:
    """The records already in the graph state under `key`. A node run by an edge has them in
    its input; a `Send` branch's input is its payload, so it reads them from the graph's state."""
    value = graph_value(config, key) if pushed(config) else None
    if value is None:
        value = state.get(key) if isinstance(state, Mapping) else getattr(state, key, None)
    return value if isinstance(value, Mapping) else {}


@moved_keywords(_READ_OPTIONS, renaming("decision_node", _READ_OPTIONS))
def decision_node(
    model: CanvasDecisionModel,
    questions: Questions,
    *,
    inputs: Inputs = None,
    route: Route = None,
    output_key: str = "decisions",
    name: str | None = None,
    review: ReviewPolicy | None = None,
    destinations: Sequence[str] | None = None,
    shadow: ExistingRouter | None = None,
    depends_on: Mapping[str, Any] | None = None,
    branch: Branch = None,
    read: ReadOptions | Mapping[str, Any] | None = None,
    history: int = 0,
) -> DecisionNode:
    """A node that answers all its questions with ONE `CanvasDecisionModel` call and routes.

    Args:
        model: The decision model. `Runtime.context.decision_model` replaces it for a run,
            and `Runtime.context.gate` (a `GatePolicy` or a dict of its fields) its gate.
        questions: `{question_id: Noul | Choice | Score}`, a function of the state returning
            one (e.g. one question per retrieved document), or a schema (a pydantic model or
            TypedDict class, as the LangGraph tutorials write `GradeDocuments`): its fields are the
            questions, its docstring the node's instructions unless `read` gives its own.
        inputs: What the model reads: None (the graph state minus `output_key`), a state
            key, or a function of the state.
        route: `(question_id, {option: node})` to go where the answer points (every option
            must map to a node; Noul options are `yes`/`no`, Score levels `"0"`, `"1"`...),
            a function returning a node (then `destinations` is required) that takes the
            decisions (`{question_id: record}`) or the decisions and the graph state (e.g. to
            stop a retry loop after `max_retries`), or None to only write the decisions.
        output_key: State key the decisions are written to, `{question_id: {answer, path,
            result, read, timing}}`. Give it the `merge_decisions` reducer when several decision
            nodes (or `Send` branches) write it; a state schema without it drops the records
            (the node warns once).
        name: Node name when added without one (default `decide_<route question>`).
        review: Send unsure, unescalated answers to a human via `interrupt()` (the graph needs
            a checkpointer, else the node raises `GraphSetupError`). The decision runs as a
            checkpointed task, so a resume in any process reuses its read and escalation.
        destinations: The nodes a route function may return (drawn as the node's edges).
        shadow: Shadow mode, the adoption path: your existing router (a function of the state
            returning a node, sync or async, or a Runnable) keeps routing the graph while the
            canvas reads the questions beside it without escalating (see `canvasroute.harness._shadow`).
        depends_on: `{child: (parent, answers)}` or `{child: {parent: answers or None}}`: ask a
            child only when its parents' final answers match (in a later read of the same call);
            a skipped child's record has `answer=None` and path `skipped`. The route question
            cannot be a child.
        branch: Fan-out (`Send`): what keys a branch's records, `{question_id: {branch: record}}`:
            a key of the node's input or a function of it (e.g. a document id). Default: a
            `Send` branch is keyed by its position among the step's Sends (`"0"`, `"1"`, ...);
            a node run by an ordinary edge writes flat records.
        read: How the canvases are read: `ReadOptions` (or a dict of its fields: `instructions`,
            `alone`, `steps`, `think`, `images`, `constrained`).
        history: Keep this many earlier records per question (and branch) across loop
            iterations, newest last, under each record's `history` (0: only the newest record;
            at most `MAX_HISTORY`). The earlier records are the graph state's, in a `Send` branch
            too (whose input is only its payload).

    Returns:
        A `DecisionNode`: add it with `builder.add_node("triage", node)`.

    The noise seed comes from the node's checkpoint namespace, the questions and the
    decision state (see `decision_seed`), so replaying a thread takes the same branch.
    Engine and escalation errors carry `retryable`; `RetryPolicy(retry_on=retry_on)` retries
    exactly the transient ones. Interrupts (`GraphBubbleUp`) always propagate.

    Example:
        ```python
        triage = decision_node(model, {
            "team": Choice(instructions="Which team?", criteria={"billing": None, "tech": None}),
            "urgent": Noul(instructions="Is it urgent?"),
        }, inputs="ticket", route=("team", {"billing": "billing", "tech": "tech"}))
        builder.add_node("triage", triage, retry_policy=RetryPolicy(retry_on=retry_on))
        ```
    """
    return DecisionNode(model, questions, inputs=inputs, route=route, output_key=output_key, name=name,
                        review=review, destinations=destinations, shadow=shadow, depends_on=depends_on,
                        branch=branch, read=read, history=history)


# -- routes ----------------------------------------------------------------------------------


def parse_route(route: Route) -> tuple[str | None, dict[str, str] | None, Callable[..., str] | None]:
    if route is None:
        return None, None, None
    if callable(route):
        return None, None, route
    if (isinstance(route, tuple) and len(route) == 2 and isinstance(route[0], str)
            and isinstance(route[1], Mapping) and route[1]):
        paths = {str(option): target for option, target in route[1].items()}
        bad = [t for t in paths.values() if not isinstance(t, str) or not t]
        if bad:
            raise ValueError(f"route targets must be node names, got {bad}")
        return route[0], paths, None
    raise TypeError("route must be (question_id, {option: node}), a function of the decisions, or None")


def check_path_map(qid: str, options: Sequence[str], paths: Mapping[str, str], what: str) -> None:
    """Every option of `qid` maps to a node, and nothing else does (`what`: route or path_map)."""
    missing = [o for o in options if o not in paths]
    unknown = [o for o in paths if o not in options]
    if missing or unknown:
        parts = [(f"{what} for {qid!r} must map every option of the question to a node (its options: "
                  f"{list(options)})")]
        if missing:
            parts.append(f"no node for {missing}")
        if unknown:
            parts.append(f"{unknown} {'is' if len(unknown) == 1 else 'are'} not among its options")
        raise ValueError("; ".join(parts))


def _takes_state(fn: Callable[..., Any]) -> bool:
    """Whether a route function takes the graph state after the decisions (two positional parameters)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: decisions only
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def route_destinations(route_map: dict[str, str] | None, route_fn: Callable[..., str] | None,
                       declared: Sequence[str] | None) -> tuple[str, ...]:
    if route_fn is not None:
        if not declared or isinstance(declared, str):
            raise ValueError("a route function needs destinations=(node, ...) naming every node it may return")
        return tuple(dict.fromkeys(declared))
    if declared is not None:
        raise ValueError("destinations= is only for route functions; a route mapping declares its own")
    return tuple(dict.fromkeys(route_map.values())) if route_map else ()


def annotated_call(destinations: tuple[str, ...]) -> Callable[..., Command[Any]]:
    """A `__call__` whose return annotation is `Command[Literal[destinations]]` (read by `add_node`)."""

    def __call__(self: Any, state: Any,  # noqa: N807 - bound as the node's own `__call__`, and named so
                 config: RunnableConfig | None = None) -> Command[Any]:
        return self.invoke(state, config)  # type: ignore[no-any-return]

    __call__.__annotations__ = {"return": Command[Literal[destinations]]}  # type: ignore[valid-type]
    return __call__


# -- fan-out ---------------------------------------------------------------------------------

_PUSH = "__pregel_push"
"""LangGraph's trigger of a task started by a `Send`."""


def branch_key(branch: Branch, state: Any, config: RunnableConfig) -> str | None:
    """The key this run's records are grouped under (None: flat records)."""
    if branch is not None:
        value = branch(state) if callable(branch) else (
            state[branch] if isinstance(state, Mapping) else getattr(state, branch))
        if value is None or (isinstance(value, str) and not value):
            raise DecisionError(f"branch= gave {value!r}: a fan-out branch needs a non-empty key")
        return str(value)
    path = (config.get("metadata") or {}).get("langgraph_path")
    if pushed(config) and path and len(path) > 1:
        return str(path[1])
    return None


def pushed(config: RunnableConfig) -> bool:
    """Whether this run was started by a `Send` (its input is the Send's payload, not the graph state)."""
    return tuple((config.get("metadata") or {}).get("langgraph_triggers") or ()) == (_PUSH,)


def grouped(decided: Decisions, key: str | None) -> dict[str, Any]:
    """`decided` as the node writes it: flat, or each record under its branch key."""
    return dict(decided) if key is None else {qid: {key: record} for qid, record in decided.items()}


class BranchKeys:
    """The branch keys claimed per superstep, so two branches never share one."""

    def __init__(self, size: int = 4096) -> None:
        self._claims: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def claim(self, node: str, step: str | None, key: str, task: str | None) -> None:
        """Record that `task` writes branch `key` in superstep `step` (its checkpoint id);
        raise when another task of the same step already does."""
        if step is None or task is None:
            return
        with self._lock:
            owner = self._claims.setdefault((step, key), task)
            self._claims.move_to_end((step, key))
            while len(self._claims) > self._size:
                self._claims.popitem(last=False)
        if owner != task:
            raise DecisionError(f"two branches of decision node {node!r} in one step have the branch key {key!r}: "
                                "their records would overwrite each other",
                                hint="make branch= give each branch its own key (e.g. a document id)")


# -- retries ---------------------------------------------------------------------------------

_DEFAULT_RETRY = RetryPolicy().retry_on


def retry_on(exc: Exception) -> bool:
    """Whether LangGraph should retry a node that raised `exc`: a transient canvasroute
    fault that no lower layer has retried already (`exc.attempts == 1`).

    Example:
        ```python
        builder.add_node("triage", node, retry_policy=RetryPolicy(retry_on=retry_on))
        ```
    """
    if isinstance(exc, CanvasRouteError):
        return exc.retryable and exc.attempts <= 1
    return bool(_DEFAULT_RETRY(exc)) if callable(_DEFAULT_RETRY) else False


__all__ = ["MAX_HISTORY", "DecisionNode", "decision_node", "retry_on"]
