"""The policy file: a `GatePolicy` as JSON, written by `canvasroute calibrate`, read by `load_policy`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from canvasroute.engine.errors import CalibrationError

from ._policy import GatePolicy

__all__ = ["POLICY_FORMAT", "load_policy", "policy_from_dict", "policy_to_dict", "save_policy"]

POLICY_FORMAT = "canvasroute.policy/1"

_POLICY_FIELDS = {f.name for f in fields(GatePolicy)}


def policy_to_dict(policy: GatePolicy) -> dict[str, Any]:
    """A `GatePolicy` as plain JSON values (nested `per_question` included)."""
    out: dict[str, Any] = {f.name: getattr(policy, f.name) for f in fields(GatePolicy) if f.name != "per_question"}
    if policy.per_question:
        out["per_question"] = {qid: policy_to_dict(p) for qid, p in policy.per_question.items()}
    return out


def policy_from_dict(data: Mapping[str, Any]) -> GatePolicy:
    """The inverse of `policy_to_dict`; unknown keys and bad values raise `CalibrationError`."""
    if not isinstance(data, Mapping):
        raise CalibrationError(f"a policy is a JSON object, not {type(data).__name__}")
    unknown = set(data) - _POLICY_FIELDS
    if unknown:
        raise CalibrationError(f"unknown policy keys {sorted(unknown)}; known: {sorted(_POLICY_FIELDS)}")
    values = dict(data)
    per_question = values.pop("per_question", None) or {}
    if not isinstance(per_question, Mapping):
        raise CalibrationError("per_question must map question ids to policies")
    try:
        return GatePolicy(**values, per_question={str(k): policy_from_dict(v) for k, v in per_question.items()})
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CalibrationError):
            raise
        raise CalibrationError(f"invalid policy: {exc}") from exc


def save_policy(path: str | Path, policy: GatePolicy, calibration: Mapping[str, Any] | None = None) -> Path:
    """Write a policy file: `{"format", "policy", "calibration"}` (the last is informational)."""
    path = Path(path)
    doc = {"format": POLICY_FORMAT, "policy": policy_to_dict(policy), "calibration": dict(calibration or {})}
    path.write_text(json.dumps(_clean(doc), indent=2, allow_nan=False) + "\n")
    return path


def load_policy(path: str | Path) -> GatePolicy:
    """Read a policy file written by `canvasroute calibrate` (or by hand).

    Example:
        ```python
        model = CanvasDecisionModel(engine=engine, policy=load_policy("policy.json"))
        ```
    """
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CalibrationError(f"cannot read policy file {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"policy file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, Mapping) or doc.get("format") != POLICY_FORMAT:
        raise CalibrationError(f"{path} is not a policy file (expected \"format\": \"{POLICY_FORMAT}\")")
    return policy_from_dict(doc.get("policy") or {})


def _clean(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, NaN and infinities become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
