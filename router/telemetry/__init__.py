"""OpenTelemetry spans and metrics (API only: the application installs the SDK).

Every attribute name the library writes is defined here. Spans:

```
decide <model>                      INTERNAL CHAIN  one decision set; per-question figures
├── canvas_read <model>             CLIENT   LLM    one engine call (first reads, then re-reads)
└── escalate <target model>         INTERNAL CHAIN  the uncertain questions, sent on
    └── chat <target model>         CLIENT   LLM    the escalation model's call
```

The escalation guards (`Escalation.breaker`: the target's circuit breaker, the cap on what
engine faults escalate) mark the decide span during which they change state or keep questions
from the target with a `canvasroute.guard` event, and count it (`canvasroute.guards`, by
`canvasroute.guard` and `canvasroute.guard.event`); a target fault a decision absorbed is a
`canvasroute.fault` event and a `canvasroute.faults` point, as an engine fault is.

An audit (live certification, `Escalation.audit`) is an `escalate` span marked `canvasroute.audit`,
started in the background after its decide span ended (its child); the decide span gets a
`canvasroute.audit` event (`sent` or `dropped`), and the `canvasroute.audits` counter points by
outcome (`sent`, `dropped`, `labelled`, `failed`).

A hedge (`Escalation.hedge`) is an `escalate` span that runs beside the re-reads' `canvas_read`,
marked `canvasroute.hedge` (`won`, `cancelled`, `failed`); the decide span gets a
`canvasroute.hedge` event per hedge, and the `canvasroute.hedges` counter a point.

Around them `harness/` writes `route <node>` (where a decision node sent the graph),
`shadow <node>` (shadow mode: the existing router and a canvas-only `decide` side by side)
and `graph <name>` (the graph's nodes and edges, for the dashboard's drawing).

Spans nest under the current span, so a graph run traced by the application (a span
around `graph.invoke`, or an OpenInference/LangSmith instrumentor) holds its decisions.
Beside the GenAI conventions, every span carries the OpenInference attributes that
trace viewers (Phoenix, Langfuse, LangSmith's OTel ingest) lay out by:
`openinference.span.kind` (CHAIN or LLM), `input.value`/`output.value` (JSON: the
questions and options in, the answers out; state text only under the content switch),
`session.id` (the LangGraph thread), `llm.model_name`/`llm.provider`/`llm.token_count.*`;
status OK, or ERROR with `error.type`.

Engine reads and escalations carry the GenAI semantic conventions
(`gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model`,
`gen_ai.response.model`, `gen_ai.request.seed` on canvas reads, `gen_ai.usage.*`,
`server.*`, `error.type`) and record the GenAI client metrics
(`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`). The deprecated
`gen_ai.system` is not written: no consumer the suite runs reads it (Phoenix and the
dashboard read `gen_ai.provider.name`). A canvas read uses the operation name
`canvas_read`: no well-known operation fits one denoising pass that returns
distributions. Every span of a decision made in a LangGraph thread carries
`gen_ai.conversation.id` (and OpenInference's `session.id`). Routing figures live under
`canvasroute.*`, never under `gen_ai.*`; the decide span carries no GenAI usage, so token
counts are never double-counted by backends that sum them over a trace.

The key set is fixed: a question id is always a value (`canvasroute.question.id` on one
`canvasroute.question` event per question of a decide span), never part of a key.

`JsonlSpanExporter` writes finished spans as JSONL (the file `canvasroute dashboard`
reads); `add_otlp_exporter` adds the standard OTLP/HTTP exporter when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set. Both are exported from `canvasroute` too.

State and prompt content are recorded only when `CANVASROUTE_RECORD_CONTENT=1`;
secrets (API keys, headers) never.

The tracer and meter are looked up from the global providers when used (not at import),
so an SDK installed after `import router` is honoured.
"""


from typing import TYPE_CHECKING, Any

from . import _names
from ._export import add_otlp_exporter
from ._names import *  # noqa: F403 - every attribute name: the fixed key set lives in `_names`
from ._spans import (
    Call,
    engine_call,
    escalation_call,
    genai_attributes,
    mark_error,
    model_call,
    provider_of,
    record_audit,
    record_audit_fault,
    record_content,
    record_controller_fault,
    record_fault,
    record_guard,
    record_hedge,
    record_reports,
    set_io,
    set_usage,
    span,
)

if TYPE_CHECKING:
    from ._jsonl import JsonlSpanExporter, span_json

__all__ = [
    "Call",
    "JsonlSpanExporter",
    "add_otlp_exporter",
    "engine_call",
    "escalation_call",
    "genai_attributes",
    "mark_error",
    "model_call",
    "provider_of",
    "record_audit",
    "record_audit_fault",
    "record_content",
    "record_controller_fault",
    "record_fault",
    "record_guard",
    "record_hedge",
    "record_reports",
    "set_io",
    "set_usage",
    "span",
    "span_json",
]
__all__ += _names.__all__


def __getattr__(name: str) -> Any:
    if name in ("JsonlSpanExporter", "span_json"):  # loads the OTel SDK: only when asked for
        from . import _jsonl

        return getattr(_jsonl, name)
    raise AttributeError(f"module 'canvasroute.router.telemetry' has no attribute {name!r}")
