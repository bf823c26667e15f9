"""`canvasroute serve`: gated decisions over HTTP at `/v1/systemone` (the Jev wire) and
`/v1/decisions` (OpenAI Decisions).

Point any Jev client (`typesafe-sdk`, OpenJev clients, `SystemOneDecisionModel`) at it;
`jev-latest`, the SDK's default model, is answered by the served model without flags. Point the
`openai` SDK (`client.decisions.create`) or langchain-openai's `OpenAIDecisions` at `<url>/v1`.
Every flag also reads a `CANVASROUTE_*` environment variable (the flag wins):

```
canvasroute serve --engine-url http://127.0.0.1:8000 --max-normalized-entropy 0.4 \\
    --escalate-url http://127.0.0.1:8001/v1 --escalate-model Qwen/Qwen3-8B --api-key $KEY
canvasroute serve --engine-url http://127.0.0.1:8000 --port 8002 \\
    --escalate-decisions http://127.0.0.1:8003/v1 --escalate-model tiny-dgemma   # a cascade of two servers
canvasroute serve --engine-url http://127.0.0.1:8001/v1     # a causal model (vllm serve <model>): detected
CANVASROUTE_ENGINE=embedded canvasroute serve      # offline SmolLM2-135M: near-chance decisions
```
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import logging.config
import os
import sys
import warnings
from typing import Any

from canvasroute.engine._extras import require_extra

from .._engine_options import ENGINE_KINDS, KIND_HELP
from .limits import ConnectionLimits, Limits
from .outcomes import SERVED

__all__ = ["build_app", "build_model", "configure", "run"]

_EPILOG = """\
Needs the [serve] extra (starlette, uvicorn, prometheus-client): pip install 'canvasroute[serve]'
(and [openai] for --escalate-url or --escalate-decisions). Every flag also reads the environment
variable named in its help.

Requests and replies follow vLLM's gateway (its systemone-openapi.yaml): its request keys
(samples, instructions, steps, think, ask, images or a multipart upload; per question
depends_on, ask_if, alone), its status codes and a diagnostics object in every 200; and
System One's (typesafe-sdk's) assets: images named by placeholders in the text.

The gate, in one order: the --policy file (its per-question fits included), then
--max-normalized-entropy and --rereads for every question (fits included), then a
request's own samples, auto_max and auto_threshold for that request. auto_threshold only
asks for more reads (re-read above it); whether an answer escalates stays the server's gate.
A certified gate (`canvasroute calibrate --max-error`) keeps its certificate while the flags
and a request's keys leave it as it was tested; one they change serves without it (a warning
at start for flags), and an uncertified gate that escalates everything passes nothing whatever
they say (one that keeps its own threshold, uncertified, claims nothing and takes them).

Outcomes: --on-uncertain escalate|answer, --on-abstain escalate|answer, --on-engine-error
escalate|raise, --on-target-fault answer|raise. A server cannot review (no human lane over HTTP), raise for an uncertain
question (no wire shape) or fall back (fallback options are per question id, and request
ids are the client's): such a model is refused at start (exit 2), and so is a policy file
holding outcomes (on_unsure, on_abstain: they are these flags now).

Checked before a request takes a slot or reaches the engine: the body must arrive within
--body-timeout (else 408) and fit --max-body-bytes (413); bad JSON, nesting over 32 levels,
lone surrogates, NaN/Infinity, a null state, an unusable question or field, over
--max-questions, --max-options, --max-levels, --max-text-chars or 256-character names is 422
(on /v1/decisions, 400); a state over --max-state-chars is 413.

Escalation rate: --target-escalation 0.2 holds 20 % of each question's answers escalated: the
question's entropy threshold moves online (a bounded step per decision, --controller-step), in
this server's process; a gate a policy file certified (calibrate --max-error) only tightens.
Each answer's `gate` (diagnostics, the x_canvasroute object) says the threshold it was held to;
/metrics shows the controller's offsets and realised rate.

The engine: --engine-url names an OpenAI-compatible server; what it serves picks the engine on
first use (DiffusionGemma's structured read: VLLMServerEngine; a plain causal model: read at each
slot for its exact label distribution, CausalServerEngine), unless --engine-kind says it.

Live certification: --audit-rate 0.02 also sends 2 % of the answers the gate passes to the
escalation target, in the background (within its budget), and moves each question's threshold to
the loosest candidate the labelled rows certify: with probability --audit-confidence (0.9), at
every moment, no certified threshold passes answers that disagree with the target more than
--audit-max-error (0.05) of the time, while the traffic is stationary; a drift detector tightens it.
Until a threshold is certified the gate passes nothing (everything escalates, and labels itself).
It needs --rereads 0. Each answer's gate says the bound, rows and audits; /metrics shows them.

Escalation targets (one of): --escalate-url URL --escalate-model NAME, an OpenAI-compatible
chat server (its structured output); --escalate-decisions URL --escalate-model NAME, an OpenAI
Decisions server (its base URL, .../v1: OpenAI, another canvasroute serve; asked through
langchain-openai's OpenAIDecisions, its distributions kept, its refusals not answers);
--escalate-systemone URL [--escalate-model NAME], a /v1/systemone server (its root URL; model
default jev-latest); --escalate-causal URL [--escalate-model NAME], a causal model on an
OpenAI-compatible server read for its exact label distribution (one read, no JSON generated;
CanvasDecisionModel.reader over CausalServerEngine). --hedge-band BAND starts the target beside
the re-reads of a question whose first read is over the gate by at most BAND; each answer's
x_canvasroute object says `hedged`.

/v1/decisions (OpenAI Decisions): every request error is 400 with OpenAI's error body
{"error": {"message", "type", "param", "code"}} naming the field (param questions[3].choices), a
model that is not served 404, the other statuses as below. A question the escalation target
refused is answered {"type": "refusal"}; with --refuse-unsure, so is one the gate did not pass
that nothing answered instead (path unsure); by default it gets the canvas's best option, as on
/v1/systemone.

Status codes (/v1/systemone): 401 bad key; 408 slow body; 413 too large; 415 not
application/json or multipart/form-data; 422 a body that is not JSON, a field, question,
feature or model that cannot be used (jev-latest is always served); 429 over --rate-limit
or the escalation budget; 502 the engine or the escalation model refused or answered garbage;
503 the engine is unreachable; 504 the engine did not answer within --request-timeout; 529 at
capacity (--max-in-flight running + --max-queue waiting) or the engine shed load. Error bodies are
{"error": {"type", "message", "code", "param"}}; 415/422 add FastAPI's "detail" list.
The API description is at GET /openapi.json.

Connections: past --max-connections a new one gets 503 and is closed; a request head must
arrive within --head-timeout (408); on SIGTERM/SIGINT requests in flight get
--shutdown-timeout seconds, then 503. A caller's X-Request-ID is logged, sent to vLLM with
every read and returned. GET /metrics serves Prometheus metrics; --log-format json writes
one JSON object per log line.
"""

_LIMIT_FLAGS = {
    "max_body_bytes": (int, "largest request body, raw and decoded; beyond it, 413"),
    "body_timeout": (float, "seconds for the whole body to arrive, before any slot is taken; beyond it, 408"),
    "max_questions": (int, "questions per request; beyond it, 422"),
    "max_options": (int, "options of one Choice; beyond it, 422"),
    "max_levels": (int, "levels of one Score; beyond it, 422"),
    "max_state_chars": (int, "characters of the state (compact JSON for objects); beyond it, 413"),
    "max_text_chars": (int, "characters of one question's instructions or criterion; beyond it, 422"),
}

log = logging.getLogger("canvasroute.serve")

_ENV = {
    "engine": "CANVASROUTE_ENGINE",
    "engine_url": "CANVASROUTE_ENGINE_URL",
    "engine_kind": "CANVASROUTE_ENGINE_KIND",
    "engine_model": "CANVASROUTE_ENGINE_MODEL",
    "engine_api_key": "CANVASROUTE_ENGINE_API_KEY",
    "policy": "CANVASROUTE_POLICY",
    "max_normalized_entropy": "CANVASROUTE_MAX_NORMALIZED_ENTROPY",
    "rereads": "CANVASROUTE_REREADS",
    "escalate_url": "CANVASROUTE_ESCALATE_URL",
    "escalate_decisions": "CANVASROUTE_ESCALATE_DECISIONS",
    "escalate_systemone": "CANVASROUTE_ESCALATE_SYSTEMONE",
    "escalate_causal": "CANVASROUTE_ESCALATE_CAUSAL",
    "escalate_model": "CANVASROUTE_ESCALATE_MODEL",
    "escalate_api_key": "CANVASROUTE_ESCALATE_API_KEY",
    "target_escalation": "CANVASROUTE_TARGET_ESCALATION",
    "controller_step": "CANVASROUTE_CONTROLLER_STEP",
    "hedge_band": "CANVASROUTE_HEDGE_BAND",
    "audit_rate": "CANVASROUTE_AUDIT_RATE",
    "audit_max_error": "CANVASROUTE_AUDIT_MAX_ERROR",
    "audit_confidence": "CANVASROUTE_AUDIT_CONFIDENCE",
    "on_uncertain": "CANVASROUTE_ON_UNCERTAIN",
    "on_abstain": "CANVASROUTE_ON_ABSTAIN",
    "on_engine_error": "CANVASROUTE_ON_ENGINE_ERROR",
    "on_target_fault": "CANVASROUTE_ON_TARGET_FAULT",
    "host": "CANVASROUTE_HOST",
    "port": "CANVASROUTE_PORT",
    "api_key": "CANVASROUTE_API_KEY",
    "max_in_flight": "CANVASROUTE_MAX_IN_FLIGHT",
    "max_queue": "CANVASROUTE_MAX_QUEUE",
    "request_timeout": "CANVASROUTE_REQUEST_TIMEOUT",
    "rate_limit": "CANVASROUTE_RATE_LIMIT",
    "model_alias": "CANVASROUTE_MODEL_ALIAS",
    "refuse_unsure": "CANVASROUTE_REFUSE_UNSURE",
    **{name: f"CANVASROUTE_{name.upper()}" for name in _LIMIT_FLAGS},
    "max_connections": "CANVASROUTE_MAX_CONNECTIONS",
    "head_timeout": "CANVASROUTE_HEAD_TIMEOUT",
    "keep_alive": "CANVASROUTE_KEEP_ALIVE",
    "shutdown_timeout": "CANVASROUTE_SHUTDOWN_TIMEOUT",
    "log_level": "CANVASROUTE_LOG_LEVEL",
    "log_format": "CANVASROUTE_LOG_FORMAT",
}
_CONNECTION_FLAGS = {
    "max_connections": (int, "open client connections at once; past it a new one is answered 503 and closed"),
    "head_timeout": (float, "seconds for a request head to arrive in full; past it, 408 and closed"),
    "keep_alive": (float, "seconds an idle kept-alive connection stays open"),
    "shutdown_timeout": (float, "seconds requests in flight may take once shutdown (SIGTERM) begins; then 503"),
}


_TRUE = ("1", "true", "yes", "on")
"""What a boolean environment variable may say for yes (any case)."""


def _env(dest: str, default: Any = None) -> Any:
    value = os.environ.get(_ENV[dest], "").strip()
    return value or default


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` flags."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine", choices=("vllm", "embedded"), default=_env("engine"),
                        help="vllm: a server (--engine-url); embedded: SmolLM2-135M in-process, near-chance "
                             "decisions, for plumbing only (default: vllm when a URL is set) [CANVASROUTE_ENGINE]")
    engine.add_argument("--engine-url", default=_env("engine_url"),
                        help="OpenAI-compatible server URL (vLLM serving DiffusionGemma, or a causal model; .../v1 "
                             "works), comma-separated for replicas [CANVASROUTE_ENGINE_URL]")
    engine.add_argument("--engine-kind", choices=ENGINE_KINDS, default=_env("engine_kind", "auto"),
                        help=KIND_HELP + " [CANVASROUTE_ENGINE_KIND]")
    engine.add_argument("--engine-model", default=_env("engine_model"),
                        help="served model name (default: the server's first) [CANVASROUTE_ENGINE_MODEL]")
    engine.add_argument("--engine-api-key", default=_env("engine_api_key"),
                        help="bearer key for the vLLM server [CANVASROUTE_ENGINE_API_KEY]")
    gate = parser.add_argument_group("gate")
    gate.add_argument("--policy", default=_env("policy"),
                      help="policy file from `canvasroute calibrate`, its per-question fits included "
                           "[CANVASROUTE_POLICY]")
    gate.add_argument("--max-normalized-entropy", type=float, default=_env("max_normalized_entropy"),
                      help="uncertain above this entropy / ln K, for every question (over the policy file's "
                           "values, per-question fits included) [CANVASROUTE_MAX_NORMALIZED_ENTROPY]")
    gate.add_argument("--rereads", type=int, default=_env("rereads"),
                      help="extra reads of uncertain questions, for every question (over the policy file's "
                           "values, per-question fits included) [CANVASROUTE_REREADS]")
    outcome = parser.add_argument_group("outcomes (what a question the gate does not pass gets)")
    outcome.add_argument("--on-uncertain", choices=SERVED["uncertain"], default=_env("on_uncertain", "escalate"),
                         help="escalate (with no target: the canvas answer, path unsure) or answer from the canvas "
                              "(path unsure) (default: %(default)s) [CANVASROUTE_ON_UNCERTAIN]")
    outcome.add_argument("--on-abstain", choices=SERVED["abstained"], default=_env("on_abstain", "escalate"),
                         help="when the policy's abstain label wins: escalate (needs a target) or answer with the "
                              "best real option (default: %(default)s) [CANVASROUTE_ON_ABSTAIN]")
    esc = parser.add_argument_group("escalation")
    esc.add_argument("--escalate-url", default=_env("escalate_url"),
                     help="OpenAI-compatible chat base URL (.../v1) of the escalation model [CANVASROUTE_ESCALATE_URL]")
    esc.add_argument("--escalate-decisions", metavar="URL", default=_env("escalate_decisions"),
                     help="an OpenAI Decisions server's base URL (.../v1: OpenAI, another canvasroute serve) as the "
                          "escalation target, with --escalate-model [CANVASROUTE_ESCALATE_DECISIONS]")
    esc.add_argument("--escalate-systemone", metavar="URL", default=_env("escalate_systemone"),
                     help="a /v1/systemone server's root URL as the escalation target (--escalate-model default: "
                          "jev-latest) [CANVASROUTE_ESCALATE_SYSTEMONE]")
    esc.add_argument("--escalate-causal", metavar="URL", default=_env("escalate_causal"),
                     help="a causal model on an OpenAI-compatible server (.../v1 works) as the escalation target, "
                          "read for its exact label distribution (--escalate-model: its served name, default the "
                          "first) [CANVASROUTE_ESCALATE_CAUSAL]")
    esc.add_argument("--escalate-model", default=_env("escalate_model"),
                     help="escalation model name [CANVASROUTE_ESCALATE_MODEL]")
    esc.add_argument("--escalate-api-key", default=_env("escalate_api_key", "EMPTY"),
                     help="key for the escalation endpoint [CANVASROUTE_ESCALATE_API_KEY]")
    esc.add_argument("--target-escalation", type=float, metavar="RATE", default=_env("target_escalation"),
                     help="hold this escalation rate (0..1) per question: an escalation-rate controller moves each "
                          "question's entropy threshold online (a certified gate only tightens; needs an "
                          "escalation target) [CANVASROUTE_TARGET_ESCALATION]")
    esc.add_argument("--controller-step", type=float, metavar="STEP", default=_env("controller_step"),
                     help="the controller's learning rate: a threshold moves by at most STEP per decision "
                          "(default 0.02; needs --target-escalation) [CANVASROUTE_CONTROLLER_STEP]")
    esc.add_argument("--hedge-band", type=float, metavar="BAND", default=_env("hedge_band"),
                     help="hedged escalation: a question whose first read is over the gate by at most BAND (on its "
                          "0..1 figures) asks the target beside its re-reads, and the first to settle it answers "
                          "(Escalation(hedge=Hedge(band=BAND))); off by default [CANVASROUTE_HEDGE_BAND]")
    esc.add_argument("--audit-rate", type=float, metavar="RATE", default=_env("audit_rate"),
                     help="live certification: send this share (0..1] of the answers the gate passes to the "
                          "escalation target too, in the background and within its budget, and move each "
                          "question's threshold to the loosest one the labelled rows certify at every moment "
                          "(needs a target and --rereads 0) [CANVASROUTE_AUDIT_RATE]")
    esc.add_argument("--audit-max-error", type=float, metavar="RATE", default=_env("audit_max_error"),
                     help="the disagreement rate with the target to certify for passed answers (default 0.05; "
                          "needs --audit-rate) [CANVASROUTE_AUDIT_MAX_ERROR]")
    esc.add_argument("--audit-confidence", type=float, metavar="P", default=_env("audit_confidence"),
                     help="the confidence of that bound, at every moment (default 0.9; needs --audit-rate) "
                          "[CANVASROUTE_AUDIT_CONFIDENCE]")
    outcome.add_argument("--on-engine-error", choices=SERVED["engine_fault"],
                         default=_env("on_engine_error", "escalate"),
                         help="engine faults escalate (when a target is set) or answer 503 (504, 529, 502 by the "
                              "fault) (default: %(default)s) [CANVASROUTE_ON_ENGINE_ERROR]")
    outcome.add_argument("--on-target-fault", choices=SERVED["target_fault"],
                         default=_env("on_target_fault", "answer"),
                         help="when the escalation target fails, or its circuit breaker is open: answer from the "
                              "canvas (path unsure, cause target_fault) or answer 502 (503 while the breaker is "
                              "open) (default: %(default)s) [CANVASROUTE_ON_TARGET_FAULT]")
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default=_env("host", "127.0.0.1"), help="bind address [CANVASROUTE_HOST]")
    srv.add_argument("--port", type=int, default=_env("port", "8000"), help="bind port [CANVASROUTE_PORT]")
    srv.add_argument("--api-key", default=_env("api_key"),
                     help="require 'Authorization: Bearer <key>' on /v1/* [CANVASROUTE_API_KEY]")
    srv.add_argument("--max-in-flight", type=int, default=_env("max_in_flight", "64"),
                     help="decisions running at once [CANVASROUTE_MAX_IN_FLIGHT]")
    srv.add_argument("--max-queue", type=int, default=_env("max_queue", "256"),
                     help="requests waiting for a slot; beyond it, 529 [CANVASROUTE_MAX_QUEUE]")
    srv.add_argument("--request-timeout", type=float, default=_env("request_timeout", "120"),
                     help="seconds from admission to answer; beyond it, 504 (529 if still queued) "
                          "[CANVASROUTE_REQUEST_TIMEOUT]")
    srv.add_argument("--rate-limit", type=float, default=_env("rate_limit"),
                     help="requests per second over all clients; beyond it, 429 [CANVASROUTE_RATE_LIMIT]")
    srv.add_argument("--refuse-unsure", action="store_true", default=str(_env("refuse_unsure", "")).lower() in _TRUE,
                     help="on /v1/decisions, answer a question the gate did not pass and nothing answered instead "
                          "(path unsure) with a refusal; default: the canvas's best option, as /v1/systemone "
                          "answers it [CANVASROUTE_REFUSE_UNSURE=1]")
    srv.add_argument("--model-alias", action="append",
                     default=[a for a in (_env("model_alias") or "").split(",") if a],
                     help="another name clients may send as `model`, besides jev-latest (repeatable) "
                          "[CANVASROUTE_MODEL_ALIAS, comma-separated]")
    bounds = parser.add_argument_group("request bounds")
    defaults = Limits()
    for name, (kind, text) in _LIMIT_FLAGS.items():
        bounds.add_argument(f"--{name.replace('_', '-')}", type=kind, default=_env(name, getattr(defaults, name)),
                            help=f"{text} (default: %(default)s) [{_ENV[name]}]")
    conns = parser.add_argument_group("connections")
    conn_defaults = ConnectionLimits()
    for name, (kind, text) in _CONNECTION_FLAGS.items():
        conns.add_argument(f"--{name.replace('_', '-')}", type=kind, default=_env(name, getattr(conn_defaults, name)),
                           help=f"{text} (default: %(default)s) [{_ENV[name]}]")
    srv.add_argument("--log-level", default=_env("log_level", "info"),
                     choices=("critical", "error", "warning", "info", "debug"), help="[CANVASROUTE_LOG_LEVEL]")
    srv.add_argument("--log-format", default=_env("log_format", "text"), choices=("text", "json"),
                     help="text lines, or one JSON object per line with the request id (default: %(default)s) "
                          "[CANVASROUTE_LOG_FORMAT]")


def _engine(args: argparse.Namespace) -> Any:
    kind = args.engine or ("vllm" if args.engine_url else None)
    if kind is None:
        raise ValueError("no engine: pass --engine-url URL (or CANVASROUTE_ENGINE_URL), or --engine embedded")
    if kind == "vllm":
        if not args.engine_url:
            raise ValueError("--engine vllm needs --engine-url (or CANVASROUTE_ENGINE_URL)")
        from canvasroute.engine import Connection
        from canvasroute.engine import Limits as EngineLimits

        from .._engine_options import server_engine

        urls = [u.strip() for u in args.engine_url.split(",") if u.strip()]
        connection = Connection(urls, api_key=args.engine_api_key,
                                limits=EngineLimits(max_concurrency=args.max_in_flight))
        return server_engine(connection, kind=args.engine_kind, model=args.engine_model)
    from canvasroute.engine import embedded_engine

    log.warning("embedded engine: SmolLM2-135M decides near chance; use it for plumbing, never for accuracy")
    return embedded_engine()


def _policy(args: argparse.Namespace) -> Any:
    """The served gate: the policy file (its per-question fits included), then the gate flags for
    every question, fits included (`resolve_gate`). A request's own keys come last, per request."""
    from canvasroute.router import GatePolicy, load_policy, resolve_gate
    from canvasroute.router._compat import gate_keywords

    policy = load_policy(args.policy) if args.policy else GatePolicy()
    if moved := gate_keywords(policy):  # a 0.1 file's outcomes: none of them can be served (outcomes.SERVED)
        fields = {"on_unsure": "OutcomePolicy.uncertain", "on_abstain": "OutcomePolicy.abstained"}
        raise ValueError(f"policy file {args.policy}: {', '.join(f'{k}={v}' for k, v in moved.items())} (canvasroute "
                         f"0.1's keys, now {', '.join(fields[k] for k in moved)}) cannot be served: a served model's "
                         "outcomes are serve's flags (--on-uncertain, --on-abstain); remove the keys from the file")
    flags = {k: v for k, v in (("max_normalized_entropy", args.max_normalized_entropy),
                               ("rereads", args.rereads)) if v is not None}
    served = resolve_gate(policy, flags)
    if voided := sorted(qid for qid, gate in policy.per_question.items() if gate.certificate is not None
                        and gate.certificate.certified and served.for_question(qid).certificate is None):
        log.warning("%s moves the certified gates of %s off what calibrate certified: they serve without their "
                    "certificates (no bound is claimed for them)",
                    " and ".join(f"--{k.replace('_', '-')}" for k in flags), ", ".join(voided))
    return served


def _escalation(args: argparse.Namespace) -> Any:
    """The escalation target the flags name (None: none): a chat server, an OpenAI Decisions
    server, a `/v1/systemone` server or a causal model read for its label distribution, each with
    its own client's retries and a 60 s timeout."""
    named = [flag for flag, value in (("--escalate-url", args.escalate_url),
                                      ("--escalate-decisions", args.escalate_decisions),
                                      ("--escalate-systemone", args.escalate_systemone),
                                      ("--escalate-causal", args.escalate_causal)) if value]
    if len(named) > 1:
        raise ValueError(f"one escalation target at a time: {' and '.join(named)} are both set")
    if not named:
        if args.escalate_model:
            raise ValueError("--escalate-model needs a target: --escalate-url, --escalate-decisions, "
                             "--escalate-systemone or --escalate-causal")
        return None
    from canvasroute.engine import Connection

    key = args.escalate_api_key
    key = None if key in (None, "", "EMPTY") else key
    if args.escalate_systemone:
        from canvasroute.router import SystemOneDecisionModel

        return SystemOneDecisionModel(Connection(args.escalate_systemone, api_key=key, timeout=60, retries=2),
                                      model=args.escalate_model or "jev-latest")
    if args.escalate_causal:
        from canvasroute.engine import CausalServerEngine
        from canvasroute.router import CanvasDecisionModel

        return CanvasDecisionModel.reader(CausalServerEngine(
            Connection(args.escalate_causal, api_key=key, timeout=60, retries=2), model=args.escalate_model))
    if not args.escalate_model:
        raise ValueError(f"escalation to {named[0]} needs --escalate-model")
    target = Connection(args.escalate_decisions or args.escalate_url, api_key=key or "EMPTY", timeout=60, retries=2)
    require_extra("openai", f"escalation to {named[0]}")
    if args.escalate_decisions:
        from langchain_core._api import LangChainBetaWarning
        from langchain_openai.decisions import OpenAIDecisions

        with warnings.catch_warnings():  # a beta API, chosen knowingly: no warning per server start
            warnings.simplefilter("ignore", LangChainBetaWarning)
            return OpenAIDecisions(model=args.escalate_model, **target.openai_options())
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=args.escalate_model, temperature=0, **target.openai_options())


def _controlled(args: argparse.Namespace, target: Any) -> Any:
    """The escalation target with the escalation-rate controller the flags ask for (`Escalation(controller=...)`)."""
    rate, step = args.target_escalation, args.controller_step
    if rate is None:
        if step is not None:
            raise ValueError("--controller-step needs --target-escalation (the rate the controller holds)")
        return target
    if target is None:
        raise ValueError("--target-escalation needs an escalation target: --escalate-url, --escalate-decisions, "
                         "--escalate-systemone or --escalate-causal (the rate is of questions escalated to it)")
    from canvasroute.router import Controller, Escalation

    return Escalation(target, controller=Controller(target=rate, **({} if step is None else {"step": step})))


def _audited(args: argparse.Namespace, target: Any) -> Any:
    """The escalation with the live certification the flags ask for (`Escalation(audit=Audit(...))`)."""
    rate, max_error, confidence = args.audit_rate, args.audit_max_error, args.audit_confidence
    if rate is None:
        for flag, value in (("--audit-max-error", max_error), ("--audit-confidence", confidence)):
            if value is not None:
                raise ValueError(f"{flag} needs --audit-rate")
        return target
    if target is None:
        raise ValueError("--audit-rate needs an escalation target: --escalate-url, --escalate-decisions or "
                         "--escalate-systemone (it labels the audited answers)")
    from canvasroute.router import Audit, Escalation

    escalation = target if isinstance(target, Escalation) else Escalation(target)
    audit = Audit(rate=float(rate), max_error=0.05 if max_error is None else float(max_error),
                  confidence=0.9 if confidence is None else float(confidence))
    return dataclasses.replace(escalation, audit=audit)


def build_model(args: argparse.Namespace) -> Any:
    """The `CanvasDecisionModel` the flags describe (its outcomes checked before the engine is built).

    Raises:
        ValueError: a flag or policy file that cannot be served (`outcomes.check_outcomes`).
    """
    from canvasroute.router import CanvasDecisionModel, Escalation, Hedge, OutcomePolicy

    from .outcomes import check_outcomes

    policy, target = _policy(args), _controlled(args, _escalation(args))
    outcomes = OutcomePolicy(uncertain=args.on_uncertain, abstained=args.on_abstain,
                             engine_fault=args.on_engine_error, target_fault=args.on_target_fault)
    check_outcomes(outcomes, policy, target is not None)
    if args.hedge_band is not None:
        if target is None:
            raise ValueError("--hedge-band needs an escalation target: --escalate-url, --escalate-decisions, "
                             "--escalate-systemone or --escalate-causal")
        escalation = target if isinstance(target, Escalation) else Escalation(target)  # (a controller's, too)
        target = dataclasses.replace(escalation, hedge=Hedge(band=args.hedge_band))
    target = _audited(args, target)
    return CanvasDecisionModel(engine=_engine(args), policy=policy, escalate_to=target, outcomes=outcomes)


def build_app(args: argparse.Namespace) -> Any:
    """The ASGI app the flags describe (what `run` serves).

    Raises:
        ExtraMissing: the `[serve]` extra (starlette, uvicorn, prometheus-client) is not installed.
    """
    require_extra("serve", "the server")
    from .app import JEV_ALIASES, create_app

    limits = dataclasses.replace(Limits(), **{name: getattr(args, name) for name in _LIMIT_FLAGS})
    return create_app(build_model(args), api_key=args.api_key, max_in_flight=args.max_in_flight,
                      max_queue=args.max_queue, request_timeout=args.request_timeout, rate_limit=args.rate_limit,
                      limits=limits, aliases=(*JEV_ALIASES, *args.model_alias), refuse_unsure=args.refuse_unsure,
                      close_engine=True)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (SIGINT/SIGTERM: a bounded graceful shutdown); 2 on a configuration error."""
    from .logs import log_config
    from .serving import server

    try:  # a configuration error changes nothing in this process (its logging included)
        limits = ConnectionLimits(**{name: getattr(args, name) for name in _CONNECTION_FLAGS})
        logging_config = log_config(args.log_format, args.log_level)
        app = build_app(args)
    except (ValueError, ImportError) as exc:
        hint = getattr(exc, "hint", None)
        print(f"canvasroute serve: {getattr(exc, 'message', exc)}" + (f"\n  hint: {hint}" if hint else ""),
              file=sys.stderr)
        return 2
    logging.config.dictConfig(logging_config)
    auth = "bearer key required" if args.api_key else "no key (open)"
    log.info("serving /v1/systemone and /v1/decisions on http://%s:%d (%s)", args.host, args.port, auth)
    # uvicorn re-raises the SIGINT it drained for (as `uvicorn.run` does, exit 0)
    with contextlib.suppress(KeyboardInterrupt):
        server(app, host=args.host, port=args.port, limits=limits, log_level=args.log_level,
               log_config=logging_config).run()
    return 0
