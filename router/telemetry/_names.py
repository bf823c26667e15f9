"""Every attribute, span and metric name canvasroute writes (one module, a fixed key set)."""

from __future__ import annotations

__all__ = [
    "AUDIT",
    "AUDIT_EVENT",
    "AUDIT_FAULT",
    "AUDIT_OUTCOME",
    "CACHE_HIT",
    "CANVAS_READS",
    "CONTROLLER_FAULT",
    "DECISION_PREFIX",
    "DECISION_SET",
    "ERROR_TYPE",
    "ESCALATED_QUESTIONS",
    "FAULT",
    "FAULT_EVENT",
    "FAULT_MESSAGE",
    "FAULT_PATHS",
    "FAULT_QUESTIONS",
    "FIGURES",
    "FIGURE_KEYS",
    "GEN_AI_CONVERSATION_ID",
    "GEN_AI_INPUT_MESSAGES",
    "GEN_AI_INPUT_TOKENS",
    "GEN_AI_MODEL",
    "GEN_AI_OPERATION",
    "GEN_AI_OUTPUT_TOKENS",
    "GEN_AI_PROVIDER",
    "GEN_AI_REQUEST_SEED",
    "GEN_AI_RESPONSE_MODEL",
    "GEN_AI_SYSTEM",
    "GEN_AI_TOKEN_TYPE",
    "GRAPH_NODE",
    "GRAPH_STRUCTURE",
    "GUARD",
    "GUARD_EVENT",
    "GUARD_WHAT",
    "HEDGE",
    "HEDGE_EVENT",
    "HEDGE_RAN_ON",
    "INPUT_MIME",
    "INPUT_VALUE",
    "JSON_MIME",
    "LLM_COMPLETION_TOKENS",
    "LLM_MODEL_NAME",
    "LLM_PROMPT_TOKENS",
    "LLM_PROVIDER",
    "LLM_SYSTEM",
    "LLM_TOTAL_TOKENS",
    "METRIC_CAUSE",
    "METRIC_KIND",
    "METRIC_PATH",
    "METRIC_QUESTION",
    "OI_CHAIN",
    "OI_LLM",
    "OI_SPAN_KIND",
    "OPERATION_CANVAS_READ",
    "OPERATION_CHAT",
    "OPERATION_ESCALATE",
    "OPERATION_GRAPH",
    "OPERATION_ROUTE",
    "OPERATION_SHADOW",
    "OUTPUT_MIME",
    "OUTPUT_VALUE",
    "PROMPTS_CONTENT",
    "QUESTIONS",
    "QUESTION_EVENT",
    "QUESTION_ID",
    "QUESTION_KIND",
    "READ_BATCH",
    "READ_KIND",
    "REMOTE_PROVIDERS",
    "ROUTE_DESTINATION",
    "SCOPE",
    "SERVER_ADDRESS",
    "SERVER_PORT",
    "SESSION_ID",
    "SHADOW_AGREES",
    "SHADOW_CANVAS_ALONE",
    "SHADOW_CANVAS_DESTINATION",
    "SHADOW_CANVAS_ERROR",
    "SHADOW_CANVAS_LATENCY",
    "SHADOW_DESTINATION",
    "SHADOW_ROUTER_LATENCY",
    "SHADOW_WOULD_ESCALATE",
    "STATE_CONTENT",
    "TARGET_CALLS",
]

# -- GenAI semantic conventions ---------------------------------------------------------
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_SYSTEM = "gen_ai.system"
"""The deprecated name of `gen_ai.provider.name`. No longer written: no consumer the suite runs
needs it (Phoenix reads `gen_ai.provider.name` first, the dashboard too); read from older trace files."""
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
"""The model that answered, as the engine or the escalation target names it."""
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
"""A canvas read's noise seed (the decision's seed; re-read k of a canvas uses seed + 7919 k)."""
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
"""The LangGraph thread, on every span of a decision made in a thread."""
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
"""Opt-in content: the prompt of a canvas read (only with CANVASROUTE_RECORD_CONTENT=1)."""
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
OPERATION_CANVAS_READ = "canvas_read"
OPERATION_CHAT = "chat"
OPERATION_ESCALATE = "escalate"
REMOTE_PROVIDERS = frozenset({"vllm"})
"""Engine providers reached over the network (their read spans are CLIENT spans)."""

# -- OpenInference semantic conventions (what Phoenix and similar viewers lay out by) ---
OI_SPAN_KIND = "openinference.span.kind"
OI_CHAIN = "CHAIN"
OI_LLM = "LLM"
INPUT_VALUE = "input.value"
INPUT_MIME = "input.mime_type"
OUTPUT_VALUE = "output.value"
OUTPUT_MIME = "output.mime_type"
JSON_MIME = "application/json"
SESSION_ID = "session.id"
"""The LangGraph thread id (viewers group a thread's traces into one session), beside
`gen_ai.conversation.id`."""
LLM_MODEL_NAME = "llm.model_name"
LLM_PROVIDER = "llm.provider"
LLM_SYSTEM = "llm.system"
LLM_PROMPT_TOKENS = "llm.token_count.prompt"
LLM_COMPLETION_TOKENS = "llm.token_count.completion"
LLM_TOTAL_TOKENS = "llm.token_count.total"

# -- canvasroute's own namespace -------------------------------------------------------
DECISION_SET = "canvasroute.decision_set"
QUESTIONS = "canvasroute.questions"
CANVAS_READS = "canvasroute.canvas_reads"
GRAPH_NODE = "canvasroute.graph.node"
READ_BATCH = "canvasroute.read.batch_size"
READ_KIND = "canvasroute.read.kind"
"""`first` or `reread`."""
ESCALATED_QUESTIONS = "canvasroute.escalation.questions"
STATE_CONTENT = "canvasroute.content.state"
"""Opt-in content: the rendered state (only with CANVASROUTE_RECORD_CONTENT=1)."""
PROMPTS_CONTENT = "canvasroute.content.prompts"
"""Opt-in content: every distinct prompt of a read batch that holds more than one."""
QUESTION_EVENT = "canvasroute.question"
"""Span event on a decide span, one per question: `canvasroute.question.id`, `.kind` and the
figures under `FIGURE_KEYS`. A question id is always a value, never part of a key."""
QUESTION_ID = "canvasroute.question.id"
QUESTION_KIND = "canvasroute.question.kind"
DECISION_PREFIX = "canvasroute.decision"
FIGURES = ("answer", "canvas_answer", "options", "canvas_probabilities", "temperature", "entropy",
           "normalized_entropy", "confidence", "margin", "label_mass", "path", "escalated",
           "escalation_model", "cause", "reads", "agreement", "crossed", "gate", "hedged", "escalation_error",
           "live_threshold", "live_bound", "live_rows", "live_audits")
"""Figures recorded per question (`canvas_*`: the canvas read before escalation, with
`canvas_probabilities` in `options` order, at `temperature`; `crossed`: the thresholds the read
crossed, absent when it passed; `gate`: `GatePolicy.gate_text`; `path` and `cause`: the outcome
vocabulary of `ReadReport`; `hedged`: True when the target was asked beside its re-reads;
`escalation_error`: the target's failure, or its open breaker, that left it unanswered;
`live_*`, under live certification (`Audit`): the certified threshold the gate passed at (absent
while it passes nothing), the current bound on its disagreement rate, the rows it rests on and
the audits spent on the question, every worker's)."""
FIGURE_KEYS = {figure: f"{DECISION_PREFIX}.{figure}" for figure in FIGURES}
"""Figure -> its attribute key on a question event (`canvasroute.decision.entropy`, ...): a fixed set.
(Trace files written before 0.2 hold them on the span as `canvasroute.decision.<question id>.<figure>`.)"""
# the graph around the decisions (written by harness/, read by the dashboard)
OPERATION_ROUTE = "route"
"""Span `route <node>`: where one decision node sent the graph (one per decision set)."""
ROUTE_DESTINATION = "canvasroute.route.destination"
"""The node the graph went to (in shadow mode: the existing router's choice)."""
GRAPH_STRUCTURE = "canvasroute.graph.structure"
"""JSON `{"nodes": [...], "edges": [{"source", "target", "conditional"}]}` of `graph.get_graph()`,
on a `graph <name>` span (`canvasroute.apps.observability.graph.record_graph`)."""
OPERATION_GRAPH = "graph"
CACHE_HIT = "canvasroute.cache.hit"
"""True on a decide or route span answered from a decision cache (read by the dashboard)."""
OPERATION_SHADOW = "shadow"
"""Span `shadow <node>`: the existing router and a canvas-only read side by side."""
SHADOW_DESTINATION = "canvasroute.shadow.destination"
"""What the existing router chose (the graph went there)."""
SHADOW_CANVAS_DESTINATION = "canvasroute.shadow.canvas_destination"
"""Where the canvas answers would have routed (absent when the canvas read failed)."""
SHADOW_AGREES = "canvasroute.shadow.agrees"
SHADOW_WOULD_ESCALATE = "canvasroute.shadow.would_escalate"
"""Question ids the gate would have escalated at the current thresholds (comma-separated)."""
SHADOW_CANVAS_ALONE = "canvasroute.shadow.canvas_alone"
"""True when no question would have escalated: the canvas would have taken the decision alone."""
SHADOW_ROUTER_LATENCY = "canvasroute.shadow.router_latency_s"
SHADOW_CANVAS_LATENCY = "canvasroute.shadow.canvas_latency_s"
SHADOW_CANVAS_ERROR = "canvasroute.shadow.canvas_error"
"""The exception type when the canvas read failed (the graph still follows the router)."""
FAULT_EVENT = "canvasroute.fault"
"""Span event on a decide span for each engine fault and each escalation target fault the decision
absorbed: `error.type`, `canvasroute.fault.message`, `canvasroute.fault.questions`,
`canvasroute.fault.paths` (what answered instead); the span also carries `canvasroute.fault` =
the error type."""
FAULT = "canvasroute.fault"
HEDGE = "canvasroute.hedge"
"""How a hedge (`Escalation.hedge`) ended: `won`, `cancelled`, `failed` or `refused` (the budget turned
it away), on its `escalate` span (none for `refused`) and on the `canvasroute.hedges` metric points."""
HEDGE_RAN_ON = "canvasroute.hedge.ran_on"
"""True on a cancelled hedge's `escalate` span when its sync target's call ran on in its thread (a
thread cannot be cancelled); the `canvasroute.hedges.ran_on` counter has a point for each."""
TARGET_CALLS = "canvasroute.escalation.calls"
"""On an `escalate` span: the calls it handed the target (a malformed reply's retry is a second; a
hedge cancelled before its call went out, 0)."""
HEDGE_EVENT = "canvasroute.hedge"
"""Span event on a decide span for each hedge: `canvasroute.hedge` (how it ended) and
`canvasroute.escalation.questions` (what it asked)."""
GUARD = "canvasroute.guard"
"""Which escalation guard (`Escalation.breaker`) spoke: `breaker` (the target's circuit breaker) or
`fault_cap` (the cap on what engine faults escalate), on `canvasroute.guard` events and on the
`canvasroute.guards` metric points."""
GUARD_EVENT = "canvasroute.guard"
"""Span event on the decide span during which a guard changed state or kept questions from the
target: `canvasroute.guard`, `canvasroute.guard.event` (`GUARD_WHAT`), `canvasroute.fault.message`
(what happened, in words) and, when it kept some, `canvasroute.escalation.questions`."""
GUARD_WHAT = "canvasroute.guard.event"
"""What a guard did. The breaker: `open` (it opened), `half_open` (a probe call is let through),
`closed` (the target answered again), `short_circuit` (a decision's questions were kept from the
target while open). The fault cap: `capped` (it began refusing), `uncapped` (it grants again),
`refused` (a decision's engine faults past the cap were not escalated)."""
FAULT_MESSAGE = "canvasroute.fault.message"
FAULT_QUESTIONS = "canvasroute.fault.questions"
FAULT_PATHS = "canvasroute.fault.paths"
CONTROLLER_FAULT = "canvasroute.controller.fault"
"""On a decide span whose escalation-rate controller could not record its outcomes (a shared
store down): the error type. The decision's answers stand; the fault is logged and counted
(`canvasroute.controller.faults`)."""
AUDIT = "canvasroute.audit"
"""True on the `escalate` span of an audit (live certification: the labeller asked about an answer
the gate passed, in the background)."""
AUDIT_EVENT = "canvasroute.audit"
"""Span event on a decide span whose sampled answers were sent to the labeller (or dropped because
the budget refused them): `canvasroute.audit.outcome` and `canvasroute.escalation.questions`."""
AUDIT_OUTCOME = "canvasroute.audit.outcome"
"""`sent`, `dropped` (the budget refused it), `labelled` or `failed` (the labeller's transport: not
counted), on audit events and on the `canvasroute.audits` metric points."""
AUDIT_FAULT = "canvasroute.audit.fault"
"""On a decide span whose live certification state could not be read or written (a shared store
down): the error type. The answers stand; logged and counted (`canvasroute.audit.faults`)."""
# metric attributes (low cardinality: developer-defined names only)
METRIC_PATH = "canvasroute.path"
METRIC_CAUSE = "canvasroute.cause"
METRIC_KIND = QUESTION_KIND
METRIC_QUESTION = QUESTION_ID

SCOPE = "canvasroute"
