"""`decision_node`: a LangGraph node that answers its questions with one canvas read.

The node is a `Runnable` with a native async path (`ainvoke`, so parallel branches read
concurrently and `TimeoutPolicy` applies) and a sync path (`invoke`, so `graph.invoke`
works). It returns `Command(goto=..., update={output_key: ...})`, so the decision is
written into state, checkpointed, cached and retried with the node.

How the drawing learns the targets: LangGraph's public ways are a node's
`Command[Literal[...]]` return annotation (read from `__call__` by `add_node`) and
`add_node(..., destinations=...)`. A node cannot reach `add_node`'s arguments, so each
`DecisionNode` gets its own bound `__call__` annotated with exactly its destinations, and
`builder.add_node("triage", decision_node(...))` draws only the real edges. Passing
`destinations=node.destinations` draws the same; pass `destinations={node: label}` to
label the edges.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any

from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_async_callback_manager_for_config, get_callback_manager_for_config
from langgraph.types import CachePolicy, Command

from canvasroute.engine import DecisionError
from canvasroute.router import (CanvasDecisionModel, CanvasResponse, QuestionSpec, fixed_read_options,
                                image_digests, parse_questions, read_state)

from ._context import GraphCall, Inputs, child_config, complete, decision_seed, graph_call, observed, select_inputs
from ._durable import adurable, durable
from ._fanout import Branch, BranchKeys, branch_key, grouped
from ._graph import check_review, state_lacks, warn_dropped
from ._node_cache import stable_json
from ._records import entries, trace_route
from ._review import ReviewPolicy, check_parents_unreviewed, pending_review, review, review_for
from ._routes import Route, annotated_call, parse_route, route_destinations
from ._shadow import ExistingRouter, Shadow, ShadowOutcome
from ._stream import DECISION_EVENT, REVIEW_EVENT, aemit, emit, event

Questions = Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]
"""Static `{question_id: Noul | Choice | Score}`, or a function of the graph state."""


class DecisionNode(Runnable[Any, Command]):
    """A graph node that asks its questions in one canvas read and routes on the answers.

    Build it with `decision_node(...)`; see there for the arguments.
    """

    def __init__(self, model: CanvasDecisionModel, questions: Questions, *, inputs: Inputs, route: Route,
                 output_key: str, name: str | None, review: ReviewPolicy | None,
                 destinations: Sequence[str] | None, shadow: ExistingRouter | None = None,
                 depends_on: Mapping[str, Any] | None = None, branch: Branch = None,
                 read_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(model, CanvasDecisionModel):
            raise TypeError(f"model must be a CanvasDecisionModel, not {type(model).__name__}")
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
        self.read_options = fixed_read_options(read_options)
        self.model = model
        self.questions = questions
        self.inputs = inputs
        self.output_key = output_key
        self.review = review
        self.route_question, self.route_map, self.route_fn = parse_route(route)
        self.destinations = route_destinations(self.route_map, self.route_fn, destinations)
        """The nodes this node can go to (what the graph drawing shows)."""
        self.name = name or (f"decide_{self.route_question}" if self.route_question else "decide")
        self.depends_on = dict(depends_on) if depends_on else None
        """`{child: (parent, answers)}`: children asked only when their parent's answer matches."""
        if self.depends_on and self.route_question in self.depends_on:
            raise ValueError(f"route question {self.route_question!r} cannot depend on another question: "
                             "when it is skipped there is no answer to route on")
        if review is not None:
            check_parents_unreviewed(self.name, self.depends_on, review.questions)
        if isinstance(questions, Mapping):
            self._check(parse_questions(questions))
        self.branch = branch
        """What keys a fan-out branch's records (None: a `Send`'s position; no `Send`: flat records)."""
        self._branches = BranchKeys()
        self._schema_checked = False
        self._node_cache = False
        if shadow is not None and review is not None:
            raise ValueError("shadow= and review= do not combine: in shadow mode the existing router decides")
        self.shadow = Shadow(shadow, self.destinations) if shadow is not None else None
        """The existing router this node shadows (None: the canvas routes)."""
        if self.destinations:
            self.__call__ = MethodType(annotated_call(self.destinations), self)

    def __repr__(self) -> str:
        route = self.route_question or ("callable" if self.route_fn else None)
        return f"DecisionNode(name={self.name!r}, route={route!r}, destinations={self.destinations!r})"

    def __call__(self, state: Any, config: RunnableConfig | None = None) -> Command:
        """Run the node synchronously (what `invoke` does)."""
        return self.invoke(state, config)

    def cache_policy(self, ttl: int | None = None) -> CachePolicy:
        """A LangGraph `CachePolicy` keyed on this node's questions, decision state and policy.

        `builder.add_node("triage", node, cache_policy=node.cache_policy(ttl=300))` with
        `builder.compile(cache=NodeCache(InMemoryCache()))`: an identical decision about an
        identical decision state is not read again (the key is `cache_key`). `NodeCache`
        (`canvasroute.harness`) keeps LangGraph from storing a decision that an engine fault
        or a budget refusal touched, which a plain LangGraph cache would replay for its TTL.
        """
        self._node_cache = True
        return CachePolicy(key_func=self.cache_key, ttl=ttl)

    def cache_key(self, state: Any) -> str:
        """The node cache's key for deciding on `state`: a SHA-256 (hex) of what the node asks
        (its name, its questions, resolved from the state when they are a function of it,
        their conditions, its `read_options`), what it reads (`inputs`, rendered as the model
        sees it, images by digest) and its model's gate (policy, served name, constrained flag).

        With `branch=`, the branch's key enters it too (a fan-out hit replays its own
        branch's records); a cached node in a `Send` fan-out needs `branch=`.
        The rest of the graph state does not enter the key, so an unrelated key changing
        does not cause a re-read. The key is the same in every process and Python run
        (no hash-randomised ordering), so workers sharing a cache share its hits.
        LangGraph calls it with the node's input only, not its config: a run-scoped
        `Runtime.context` override (`decision_model`, `gate`) is not part of the key, so do
        not combine a node cache with per-run overrides. A hit replays the node's `Command`
        without running it (LangGraph marks it `{"__metadata__": {"cached": True}}` in the
        `updates` stream) and emits no decide span.
        """
        questions = self.questions(state) if callable(self.questions) else self.questions
        asked = {qid: q.model_dump(mode="json") if hasattr(q, "model_dump") else q for qid, q in questions.items()}
        decision_state = select_inputs(state, self.inputs, self.output_key)
        model = self.model
        branch = branch_key(self.branch, state, {}) if self.branch is not None else None
        text, images = read_state(decision_state)
        blob = json.dumps([self.name, asked, self.depends_on, text, list(image_digests(images)), repr(model.policy),
                           model.model, model.constrained, branch, self.read_options], sort_keys=True,
                          default=stable_json)
        return hashlib.sha256(blob.encode()).hexdigest()

    # -- Runnable -----------------------------------------------------------------------

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Command:
        """Decide synchronously (`graph.invoke`): one read for all questions, then route."""
        config = complete(config)
        job = self._prepare(input, config, get_callback_manager_for_config)
        if self.shadow is not None:
            model = job.call.model.canvas_only()
            command, payload = self._finish_shadow(job, *self.shadow.run(
                input, config, lambda: model.invoke(job.shadow_request, child_config(config)), self._canvas_goto,
                job.call.attributes, job.call.node))
        elif job.review is None:
            command, payload = self._finish(job, self._read(job, config))
        else:
            response, fresh = durable(lambda: self._read(job, config))
            if (waiting := self._review_event(job, response, fresh)) is not None:
                emit(waiting, config, job.observed)
            command, payload = self._finish(job, response, self._human(job, response))
        emit(payload, config, job.observed)
        return command

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Command:
        """Decide asynchronously (`graph.ainvoke`): one read for all questions, then route."""
        config = complete(config)
        job = self._prepare(input, config, get_async_callback_manager_for_config)
        if self.shadow is not None:
            model = job.call.model.canvas_only()
            command, payload = self._finish_shadow(job, *await self.shadow.arun(
                input, config, lambda: model.ainvoke(job.shadow_request, child_config(config)), self._canvas_goto,
                job.call.attributes, job.call.node))
        elif job.review is None:
            command, payload = self._finish(job, await self._aread(job, config))
        else:
            response, fresh = await adurable(lambda: self._aread(job, config))
            if (waiting := self._review_event(job, response, fresh)) is not None:
                await aemit(waiting, config, job.observed)
            command, payload = self._finish(job, response, self._human(job, response))
        await aemit(payload, config, job.observed)
        return command

    # -- the decision -------------------------------------------------------------------

    def _prepare(self, state: Any, config: RunnableConfig, manager_for: Callable[[RunnableConfig], Any]) -> _Job:
        call = graph_call(config, self.model, self.name)
        questions = dict(self.questions(state) if callable(self.questions) else self.questions)
        reviewing = None if self.shadow is not None else review_for(
            self.review, call.policy or call.model.policy, questions, self.depends_on, call.node)
        if reviewing is not None:
            check_review(config, call.node)  # before any read: an interrupt nobody could resume
        if not self._schema_checked:  # once per node, at its first run in a graph
            lacks = state_lacks(config, self.output_key)
            self._schema_checked = lacks is not None
            if lacks:
                warn_dropped(call.node, self.output_key)
        specs: Mapping[str, QuestionSpec] = {}  # static questions were checked when the node was built
        if callable(self.questions) or reviewing is not None:
            specs = parse_questions(questions)
        if callable(self.questions):
            self._check(specs)
        branch = branch_key(self.branch, state, config)
        if branch is not None:
            if self._node_cache and self.branch is None:  # a hit would replay another branch's key
                raise DecisionError(f"decision node {call.node!r} has a node cache and runs in a Send fan-out: "
                                    "its records need a key of the branch's input",
                                    hint="pass decision_node(..., branch=<a key of the branch's input>)")
            self._branches.claim(call.node, call.checkpoint_id, branch, call.task_id)
        decision_state = select_inputs(state, self.inputs, self.output_key)
        seed = decision_seed(call.namespace, "node", questions, decision_state)
        options = {"seed": seed, "thread_id": call.thread_id, "policy": call.policy, "attributes": call.attributes,
                   "depends_on": self.depends_on, "budget_meter": call.budget_meter, **self.read_options}
        request = {"state": decision_state, "questions": questions, **options}
        options = {k: v for k, v in options.items() if v is not None}
        return _Job(call, specs, questions, decision_state, seed, request, options, branch,
                    observed(config, manager_for), reviewing)

    def _read(self, job: _Job, config: RunnableConfig) -> CanvasResponse:
        if not job.observed:
            return job.call.model.decide(job.state, job.questions, **job.options)
        return job.call.model.invoke(job.request, child_config(config))

    async def _aread(self, job: _Job, config: RunnableConfig) -> CanvasResponse:
        if not job.observed:
            return await job.call.model.adecide(job.state, job.questions, **job.options)
        return await job.call.model.ainvoke(job.request, child_config(config))

    def _review_event(self, job: _Job, response: CanvasResponse, fresh: bool) -> dict[str, Any] | None:
        """The event a decision waiting for a human sends before its interrupt (once: not on a resume)."""
        assert job.review is not None
        pending = pending_review(job.review, response)
        if not (pending and fresh):
            return None
        return event(REVIEW_EVENT, job.call.node, None, entries(response, {}), job.seed, branch=job.branch,
                     review=pending)

    def _human(self, job: _Job, response: CanvasResponse) -> dict[str, str]:
        """The human's options (interrupts the first time; a resume returns them)."""
        assert job.review is not None
        options = {qid: spec.options for qid, spec in job.specs.items()}
        return review(job.review, job.call.node, response, options, job.questions, job.state)

    def _finish(self, job: _Job, response: CanvasResponse,
                human: Mapping[str, str] | None = None) -> tuple[Command, dict[str, Any]]:
        decided = entries(response, human or {})
        goto = self._goto(decided)
        trace_route(job.call.attributes, goto)
        update = {self.output_key: grouped(decided, job.branch)}
        command = Command(update=update) if goto is None else Command(goto=goto, update=update)
        return command, event(DECISION_EVENT, job.call.node, goto, decided, job.seed, branch=job.branch)

    def _canvas_goto(self, response: CanvasResponse) -> str | None:
        return self._goto(entries(response, {}))

    def _finish_shadow(self, job: _Job, response: CanvasResponse | None,
                       outcome: ShadowOutcome) -> tuple[Command, dict[str, Any]]:
        """Go where the existing router said; record what the canvas would have done."""
        decided = entries(response, {}) if response is not None else {}
        for qid, record in decided.items():
            record["shadow"] = outcome.record(qid)
        trace_route(job.call.attributes, outcome.destination)
        update = {self.output_key: grouped(decided, job.branch)} if decided else None
        return Command(goto=outcome.destination, update=update), event(
            DECISION_EVENT, job.call.node, outcome.destination, decided, job.seed, branch=job.branch,
            shadow=outcome.record())

    def _goto(self, decided: dict[str, dict[str, Any]]) -> str | None:
        if self.route_fn is not None:
            goto = self.route_fn(decided)
            if goto not in self.destinations:
                raise ValueError(f"{self.name}: route returned {goto!r}, which is not one of the declared "
                                 f"destinations {list(self.destinations)}")
            return goto
        if self.route_map is not None:
            return self.route_map[decided[self.route_question]["answer"]]
        return None

    def _check(self, specs: Mapping[str, QuestionSpec]) -> None:
        """The routing question exists and every one of its options has a node."""
        if self.route_map is None:
            return
        qid = self.route_question
        if qid not in specs:
            raise ValueError(f"route question {qid!r} is not among the questions {list(specs)}")
        options = set(specs[qid].options)
        missing, unknown = sorted(options - set(self.route_map)), sorted(set(self.route_map) - options)
        if missing or unknown:
            raise ValueError(f"route for {qid!r} must map every option to a node; "
                             f"missing {missing}, not options {unknown}")


@dataclass(slots=True)
class _Job:
    """One node run between preparing the request and building the `Command`."""

    call: GraphCall
    specs: Mapping[str, QuestionSpec]
    questions: dict[str, Any]
    state: Any
    seed: int
    request: dict[str, Any]
    options: dict[str, Any]
    """The request's keywords for `adecide` (those set)."""
    branch: str | None
    """The fan-out branch key its records are grouped under (None: flat)."""
    observed: bool
    """A callback handler would see the model's run (else `adecide` is called directly)."""
    review: ReviewPolicy | None
    """What goes to a human in this run (`review_for`; None: nothing)."""

    @property
    def shadow_request(self) -> dict[str, Any]:
        """The request a shadow read sends: no budget (the shadow never escalates)."""
        return {**self.request, "budget_meter": None}


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
    read_options: Mapping[str, Any] | None = None,
) -> DecisionNode:
    """A node that answers all its questions with ONE `CanvasDecisionModel` call and routes.

    Args:
        model: The decision model. `Runtime.context.decision_model` replaces it for a run,
            and `Runtime.context.gate` (a `GatePolicy` or a dict of its fields) its gate.
        questions: `{question_id: Noul | Choice | Score}`, or a function of the state
            returning one (e.g. one question per retrieved document).
        inputs: What the model reads: None (the graph state minus `output_key`), a state
            key, or a function of the state.
        route: `(question_id, {option: node})` to go where the answer points (every option
            must map to a node; Noul options are `yes`/`no`, Score levels `"0"`, `"1"`...),
            a function of the decisions returning a node (then `destinations` is required),
            or None to only write the decisions and follow the graph's edges.
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
            canvas reads the questions beside it without escalating. Each record gets a
            `shadow` entry (agreement, would-escalate, both latencies), and a `shadow <node>`
            span and the custom-stream event carry the same. See `canvasroute.harness._shadow`.
        depends_on: `{child: (parent, answers)}`: ask a child only when its parent's final
            answer is one of `answers` (in a second read of the same call); a skipped child's
            record has `answer=None` and path `skipped`. The route question cannot be a child.
        branch: Fan-out (`Send`): what keys a branch's records, `{question_id: {branch: record}}`:
            a key of the node's input or a function of it (e.g. a document id). Default: a
            `Send` branch is keyed by its position among the step's Sends (`"0"`, `"1"`, ...);
            a node run by an ordinary edge writes flat records. See `canvasroute.harness._fanout`.
        read_options: `instructions`, `alone`, `steps`, `think`, `images`: as `adecide` takes them.

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
                        branch=branch, read_options=read_options)


__all__ = ["DecisionNode", "decision_node"]
