"""0.1 spellings of the model's, the decision's and the System One client's keywords, until 0.3.0.

Each maps exactly onto its 0.2 spelling (`canvasroute.engine._compat` has the machinery and the
engines' keywords; CHANGELOG.md, "Migrating from 0.1", the table):

- `GatePolicy(on_unsure=X)`: the model's `OutcomePolicy(uncertain=X)`; with an `escalate_to`,
  0.1 escalated instead (`escalate`). `GatePolicy(on_abstain=X)`: `OutcomePolicy(abstained=X)`.
- `EscalationBudget(when_spent=X)`: the model's `OutcomePolicy(over_budget=X)` (`keep` is `answer`).
- `CanvasDecisionModel(on_engine_error=, fallback=)`: `outcomes=OutcomePolicy(engine_fault=, fallback=)`;
  `budget=, budget_meter=, escalation_timeout=, escalation_prompt=, escalation_output=`:
  `escalate_to=Escalation(target, budget=, meter=, timeout=, prompt=, output=)`; `constrained=`:
  `read=ReadOptions(constrained=)`.
- `decide(policy=)` and `invoke({"policy": ...})`: `gate=`; `instructions=, alone=, steps=, think=,
  images=`: `read={...}`; `budget_meter=`: `arun(request(...).metered(meter))`.
- `SystemOneDecisionModel(base_url, api_key=, timeout=, max_retries=, backoff=, max_connections=,
  verify=, cert=, transport=)`: `SystemOneDecisionModel(Connection(url, ...))`.

A gate's outcome keywords are kept by the `GatePolicy` (`keep_removed`) until a model or a request
uses it: then they become the outcome fields they meant, and the gate a plain `GatePolicy`. 0.1
read them per question (an override in `per_question` replaced the whole policy, its outcome
keywords included); 0.2 has one `OutcomePolicy` for a decision, so questions whose 0.1 keywords
(given, or their defaults) meant different outcomes are refused, naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from pydantic import SecretStr

from canvasroute.engine._compat import connection_keywords, kept, take, warn_moved

from ._policy import Escalation, EscalationBudget, GatePolicy, OutcomePolicy
from ._request import READ_FIELDS, DecisionRequest, Defaults, ReadOptions, read_options

__all__ = ["DECIDE", "MODEL", "SYSTEMONE", "gate_keywords", "gate_layer", "gate_outcomes", "legacy_request",
           "model_keywords", "outcomes_of", "plain_gate", "systemone_keywords"]

_DEFAULT_OUTCOMES = OutcomePolicy()
_ESCALATION_DEFAULTS = {f.name: f.default for f in fields(Escalation) if f.name != "target"}
_SPENT = {"keep": "answer", "answer": "answer", "fallback": "fallback", "raise": "raise"}
"""`EscalationBudget.when_spent` -> `OutcomePolicy.over_budget`."""

MODEL = {
    "budget": "escalate_to=Escalation(target, budget=...)",
    "budget_meter": "escalate_to=Escalation(target, meter=...)",
    "escalation_timeout": "escalate_to=Escalation(target, timeout=...)",
    "escalation_prompt": "escalate_to=Escalation(target, prompt=...)",
    "escalation_output": "escalate_to=Escalation(target, output=...)",
    "on_engine_error": "outcomes=OutcomePolicy(engine_fault=...)",
    "fallback": "outcomes=OutcomePolicy(fallback=...)",
    "constrained": "read=ReadOptions(constrained=...)",
}
"""`CanvasDecisionModel`'s 0.1 fields and their 0.2 spelling."""
_ESCALATION_FIELDS = {"budget": "budget", "budget_meter": "meter", "escalation_timeout": "timeout",
                      "escalation_prompt": "prompt", "escalation_output": "output"}

DECIDE = {
    "policy": "gate=",
    **{name: f"read={{'{name}': ...}}" for name in ("instructions", "alone", "steps", "think", "images")},
    "budget_meter": "model.arun(model.request(...).metered(meter))",
}
"""The 0.1 keywords of `decide` / `adecide` (and keys of `invoke`'s request) and their 0.2 spelling."""

SYSTEMONE = frozenset(("base_url", "api_key", "timeout", "max_retries", "backoff", "max_connections", "verify", "cert",
                       "transport"))
"""`SystemOneDecisionModel`'s 0.1 fields: its transport, now its `Connection`'s (`CONNECTION` says where each went)."""


# -- a gate's outcome keywords --------------------------------------------------------------


def gate_outcomes(policy: GatePolicy, has_target: bool) -> dict[str, str]:
    """The `OutcomePolicy` fields a gate's 0.1 keywords (`on_unsure`, `on_abstain`, in it or in its
    per-question policies) mean, for a model with or without an escalation target.

    Raises:
        ValueError: questions whose 0.1 keywords meant different outcomes (0.2 has one per decision).
    """
    entries = [("every other question", policy), *((f"question {q!r}", p) for q, p in policy.per_question.items())]
    given = [kept(p) for _, p in entries]
    out: dict[str, str] = {}
    if any("on_unsure" in g for g in given):  # 0.1 asked it only when nothing could answer instead
        meant = {where: "escalate" if has_target else g.get("on_unsure", "answer")
                 for (where, _), g in zip(entries, given, strict=True)}
        out["uncertain"] = _one("on_unsure", "uncertain", meant)
    if any("on_abstain" in g for g in given):  # it matters for questions that may abstain
        meant = {where: g.get("on_abstain", "escalate") for (where, p), g in zip(entries, given, strict=True)
                 if p.abstain}
        if meant:
            out["abstained"] = _one("on_abstain", "abstained", meant)
    return out


def _one(keyword: str, field: str, meant: Mapping[str, str]) -> str:
    if len(set(meant.values())) > 1:
        said = ", ".join(f"{where}: {value!r}" for where, value in meant.items())
        raise ValueError(f"GatePolicy({keyword}=...) differs between questions ({said}; a per-question policy "
                         f"replaced the whole policy in 0.1, its {keyword} included): 0.2 has one OutcomePolicy "
                         f"per model, so set OutcomePolicy({field}=...) on the model and drop {keyword}=")
    return next(iter(meant.values()))


def gate_keywords(policy: GatePolicy) -> dict[str, str]:
    """The 0.1 keywords a gate holds (in it or its per-question policies), with the values given."""
    found: dict[str, set[str]] = {}
    for p in (policy, *policy.per_question.values()):
        for key, value in kept(p).items():
            found.setdefault(key, set()).add(repr(value))
    return {key: " or ".join(sorted(values)) for key, values in sorted(found.items())}


def plain_gate(policy: GatePolicy) -> GatePolicy:
    """The gate without the 0.1 keywords it kept (its per-question policies too)."""
    if not kept(policy) and not any(kept(p) for p in policy.per_question.values()):
        return policy
    values = {f.name: getattr(policy, f.name) for f in fields(GatePolicy) if f.name != "per_question"}
    return GatePolicy(**values, per_question={q: plain_gate(p) for q, p in policy.per_question.items()})


def _plain_budget(budget: Any) -> Any:
    if not kept(budget):
        return budget
    return EscalationBudget(**{f.name: getattr(budget, f.name) for f in fields(EscalationBudget)})


def outcomes_of(policy: GatePolicy, outcomes: OutcomePolicy | None, has_target: bool,
                moved: Mapping[str, Any] | None = None,
                said: Mapping[str, str] | None = None) -> tuple[GatePolicy, OutcomePolicy]:
    """A model's gate without its 0.1 keywords, and its outcomes with the fields they meant
    (`moved`: more fields 0.1 keywords meant, `said` naming those keywords; `outcomes` None: not given).

    Raises:
        TypeError: an outcome field given in both spellings, with different values.
        ValueError: per-question 0.1 keywords 0.2 cannot say (`gate_outcomes`).
    """
    meant: dict[str, Any] = {**gate_outcomes(policy, has_target), **(moved or {})}
    named = {"uncertain": "GatePolicy(on_unsure=...)", "abstained": "GatePolicy(on_abstain=...)", **(said or {})}
    if not meant:
        return policy, outcomes or _DEFAULT_OUTCOMES
    base = outcomes or _DEFAULT_OUTCOMES
    for field, value in meant.items():
        current = getattr(base, field)
        if outcomes is not None and current != getattr(_DEFAULT_OUTCOMES, field) and current != value:
            raise TypeError(f"{named[field]} means OutcomePolicy({field}={value!r}), but outcomes= says "
                            f"{field}={current!r}: give one of them")
    return plain_gate(policy), replace(base, **meant)


# -- CanvasDecisionModel's fields -----------------------------------------------------------


def model_keywords(data: Any) -> Any:
    """`CanvasDecisionModel`'s constructor data in its 0.2 spelling (its before-validator)."""
    if not isinstance(data, dict):
        return data
    policy, escalate_to = data.get("policy"), data.get("escalate_to")
    budget = escalate_to.budget if isinstance(escalate_to, Escalation) else None
    if MODEL.keys().isdisjoint(data) and not kept(budget) and not (
            isinstance(policy, GatePolicy) and (kept(policy) or any(kept(p) for p in policy.per_question.values()))):
        return data
    data = dict(data)
    old = take(data, MODEL)
    warn_moved("CanvasDecisionModel", {name: MODEL[name] for name in old})
    target = escalate_to.target if isinstance(escalate_to, Escalation) else escalate_to
    moved = {_ESCALATION_FIELDS[name]: value for name, value in old.items() if name in _ESCALATION_FIELDS}
    if "meter" in moved and "budget" not in moved and budget is None:
        raise ValueError("CanvasDecisionModel: budget_meter needs budget= (the caps it counts against)")
    escalation, spent = None, {}
    if target is not None:
        escalation = escalate_to if isinstance(escalate_to, Escalation) else Escalation(target)
        for field, value in moved.items():
            current = getattr(escalation, field)
            if current != _ESCALATION_DEFAULTS[field] and current != value:
                raise TypeError(f"CanvasDecisionModel: {_OLD_ESCALATION[field]}= beside escalate_to=Escalation"
                                f"({field}={current!r}): give one of them")
        escalation = replace(escalation, **moved)
        spent = kept(escalation.budget)
        if spent:
            escalation = replace(escalation, budget=_plain_budget(escalation.budget))
        data["escalate_to"] = escalation  # (0.1: without escalate_to nothing escalated, its settings did nothing)
    outcome_moved: dict[str, Any] = {}
    said: dict[str, str] = {}
    if "on_engine_error" in old:
        outcome_moved["engine_fault"], said["engine_fault"] = old["on_engine_error"], "on_engine_error="
    if "fallback" in old:
        outcome_moved["fallback"], said["fallback"] = dict(old["fallback"]), "fallback="
    if spent:
        outcome_moved["over_budget"] = _SPENT[spent["when_spent"]]
        said["over_budget"] = "EscalationBudget(when_spent=...)"
    given = data.get("outcomes")
    if isinstance(given, Mapping):
        given = OutcomePolicy(**given)
    if "fallback" in outcome_moved and given is not None and given.fallback and \
            dict(given.fallback) != outcome_moved["fallback"]:
        raise TypeError("CanvasDecisionModel: fallback= beside outcomes=OutcomePolicy(fallback=...): give one of them")
    gate = policy if isinstance(policy, GatePolicy) else GatePolicy()
    gate, outcomes = outcomes_of(gate, given, escalation is not None, outcome_moved, said)
    if isinstance(policy, GatePolicy):
        data["policy"] = gate
    data["outcomes"] = outcomes
    if "constrained" in old:
        read = read_options(data.get("read"))
        if read.constrained is not None and read.constrained != old["constrained"]:
            raise TypeError(f"CanvasDecisionModel: constrained= beside read=ReadOptions(constrained="
                            f"{read.constrained!r}): give one of them")
        data["read"] = replace(read, constrained=old["constrained"])
    return data


_OLD_ESCALATION = {new: old for old, new in _ESCALATION_FIELDS.items()}


# -- a decision's keywords ------------------------------------------------------------------


def legacy_request(model: Any, state: Any, questions: Any, options: dict[str, Any],
                   where: str = "CanvasDecisionModel.decide") -> DecisionRequest:
    """The request a 0.1 call of `decide` / `adecide` (or an `invoke` request with 0.1 keys)
    meant: `policy` is `gate`, the read keywords are `read`, `budget_meter` meters the request.

    Raises:
        TypeError: a setting given in both spellings.
    """
    options = dict(options)
    old = take(options, DECIDE)
    warn_moved(where, {name: DECIDE[name] for name in old})
    if "policy" in old:
        if options.get("gate") is not None:
            raise TypeError(f"{where}: policy= is the 0.1 spelling of gate=; give one of them")
        options["gate"] = old["policy"]
    if reads := {name: old[name] for name in READ_FIELDS if name in old and old[name] is not None}:
        options["read"] = _with_reads(where, options.get("read"), reads)
    request: DecisionRequest = model.request(state, questions, **options)
    return request.metered(old["budget_meter"]) if old.get("budget_meter") is not None else request


def _with_reads(where: str, read: Any, reads: Mapping[str, Any]) -> Any:
    if isinstance(read, ReadOptions):
        clash = [k for k in reads if getattr(read, k) != getattr(ReadOptions(), k)]
        if clash:
            raise TypeError(f"{where}: {', '.join(f'{k}=' for k in clash)} beside read=ReadOptions(...): give one")
        return replace(read, **reads)
    read = dict(read or {})
    if clash := [k for k in reads if read.get(k) is not None]:
        raise TypeError(f"{where}: {', '.join(f'{k}=' for k in clash)} beside read={{...}} naming them: give one")
    return {**read, **reads}


def gate_layer(defaults: Defaults, gate: Any) -> tuple[Defaults, Any]:
    """A request's gate layer (`gate=`, `Runtime.context.gate`) without 0.1 keywords, and the
    defaults with the outcomes they meant (a layer's 0.1 keywords were that decision's own)."""
    has_target = defaults.escalation is not None
    if isinstance(gate, GatePolicy):
        meant: dict[str, Any] = dict(gate_outcomes(gate, has_target))
        if meant:
            defaults = replace(defaults, outcomes=replace(defaults.outcomes, **meant))
        return defaults, plain_gate(gate)
    if not isinstance(gate, Mapping):
        return defaults, gate
    inner = gate.get("per_question")
    layers = [("every question", gate), *((f"question {q!r}", p) for q, p in (
        inner.items() if isinstance(inner, Mapping) else ()) if isinstance(p, Mapping))]
    if all(_GATE_KEYS.isdisjoint(layer) for _, layer in layers):
        return defaults, gate
    # a dict layer names fields for every question: its 0.1 keywords are this decision's outcomes
    found = set().union(*(_GATE_KEYS & set(layer) for _, layer in layers))
    warn_moved("gate", {k: f"the model's OutcomePolicy({_GATE_FIELD[k]}=...)" for k in sorted(found)})
    meant = {}
    for key, field in _GATE_FIELD.items():
        values = {where: layer[key] for where, layer in layers if key in layer}
        if values:
            value = _one(key, field, values)
            meant[field] = "escalate" if key == "on_unsure" and has_target else value
    clean = {k: v for k, v in gate.items() if k not in _GATE_KEYS}
    if isinstance(inner, Mapping):
        clean["per_question"] = {q: {k: v for k, v in p.items() if k not in _GATE_KEYS} if isinstance(p, Mapping)
                                 else p for q, p in inner.items()}
    return replace(defaults, outcomes=replace(defaults.outcomes, **meant)), clean


_GATE_FIELD = {"on_unsure": "uncertain", "on_abstain": "abstained"}
_GATE_KEYS = frozenset(_GATE_FIELD)


# -- SystemOneDecisionModel -----------------------------------------------------------------


def systemone_keywords(connection: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`SystemOneDecisionModel(base_url, api_key=, timeout=, ...)` as `SystemOneDecisionModel(Connection(url, ...))`.

    Raises:
        TypeError: `base_url=` beside a connection, or transport keywords beside a `Connection`.
    """
    spelled = {}
    if "base_url" in kwargs:
        if connection is not None or "connection" in kwargs:
            raise TypeError("SystemOneDecisionModel: base_url= is the 0.1 name of connection (the first argument); "
                            "give one of them")
        connection, spelled = kwargs.pop("base_url"), {"base_url": "the first argument (connection)"}
    if connection is None:
        connection = kwargs.pop("connection", None)
    if isinstance(connection, str):
        connection = connection.rstrip("/")  # as 0.1 did
    if isinstance(kwargs.get("api_key"), SecretStr):
        kwargs["api_key"] = kwargs["api_key"].get_secret_value()
    return connection_keywords("SystemOneDecisionModel", connection, kwargs, names=SYSTEMONE - {"base_url"},
                               spelled=spelled), kwargs

