"""Prompts: the system prompt that lists the questions and the answer-canvas text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.decisions import Choice, Noul

from canvasroute.engine import SPECIAL_CANDIDATES, EngineInfo, defuse

from ._questions import ABSTAIN_TEXT, QuestionSpec, option_text

LINES_FORMAT = 'Reply with one line per question, in this order, formatted as "id: label".'
COMPACT_FORMAT = ("Reply on one line: each question's id directly followed by its label, in this order, "
                  "separated by single spaces (for example q1A q2B).")


def system_prompt(specs: Sequence[QuestionSpec], labels: Sequence[Sequence[str]],
                  special_tokens: Sequence[str] | None = None, *, compact: bool = False) -> str:
    """The question list for one chunk. Caller ids are hidden behind q1, q2, ...

    Instructions, option names and criteria are defused like the state (`canvasroute.engine.defuse`
    with the engine's special tokens): a question built from state cannot forge tokens.
    """
    specials = special_tokens or SPECIAL_CANDIDATES

    def text(content: Any) -> str:
        return defuse(option_text(content), specials)

    parts = ["Read the input and answer every question below."]
    for n, (spec, alphabet) in enumerate(zip(specs, labels, strict=True), 1):
        q = spec.question
        again = " (the same question again, options in another order)" if spec.shift else ""
        lines = [f"Question q{n}: {text(q.instructions)}{again}"]
        if spec.abstain:  # the last label is "none of these / can't tell"
            alphabet, abstain = alphabet[:-1], alphabet[-1]
        if isinstance(q, Noul):
            crit = q.criteria
            yes = text(crit.true) if crit and crit.true is not None else "yes"
            no = text(crit.false) if crit and crit.false is not None else "no"
            lines += [f"{alphabet[0]}: {yes}", f"{alphabet[1]}: {no}"]
        elif isinstance(q, Choice):
            for label, (name, desc) in zip(alphabet, q.criteria.items(), strict=True):
                lines.append(f"{label}: {text(name)}" + (f" ({text(desc)})" if desc not in (None, "") else ""))
        else:
            lines += [f"{label}: {text(desc)}" for label, desc in zip(alphabet, q.criteria, strict=True)]
        if spec.abstain:
            lines.append(f"{abstain}: {ABSTAIN_TEXT}")
        parts.append("\n".join(lines))
    parts.append(COMPACT_FORMAT if compact else LINES_FORMAT)
    return "\n\n".join(parts)


def template_text(info: EngineInfo, labels: Sequence[str], *, compact: bool = False) -> str:
    """The answer canvas text: the thought block where the prompt lacks it
    (`info.canvas_prefix`), the answers, and the end of turn right after the last one (as
    vLLM's reference gateway builds it). Answers are `qN: label` lines, or `qNlabel` words
    separated by spaces when `compact` (a token or more less per question)."""
    if compact:
        body = " ".join(f"q{n}{label}" for n, label in enumerate(labels, 1))
    else:
        body = "\n".join(f"q{n}: {label}" for n, label in enumerate(labels, 1))
    return f"{info.canvas_prefix}{body}{info.end_of_turn}"
