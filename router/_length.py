"""Length: refuse a decision before any read when one of its reads would not fit the model.

Every read a plan can send is checked: each chunk's first read (its re-reads share its
prompt) and, for a question read in two steps, the in-group read of every group, since
which group is read is known only after the first read. A token covers at least one
UTF-8 byte, so a byte count bounds a prompt cheaply; only prompts near the limit are
tokenized exactly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from canvasroute.engine import Engine, EngineInfo, InputTooLong

from ._options import ReadOptions
from ._plan import Chunk, Plan
from ._reading import messages

MemberPlan = Callable[[Plan, str, int], Awaitable[Plan]]
"""(plan, question id, group) -> the plan of that group's in-group read."""


async def check_length(engine: Engine, info: EngineInfo, the_plan: Plan, state_text: str,
                       member_plan: MemberPlan, opts: ReadOptions) -> None:
    """Raise `InputTooLong` when prompt + canvas (+ a thought's `opts.think` tokens, for the
    reads that continue one) of any read of `the_plan` exceed the context."""
    for chunk in the_plan.chunks:
        await _check(engine, info, chunk, state_text, opts.instructions, opts.think, None)
    for qid, route in the_plan.routes.items():
        for group in range(len(route.groups)):
            for chunk in (await member_plan(the_plan, qid, group)).chunks:
                await _check(engine, info, chunk, state_text, opts.instructions, 0, qid)


async def _check(engine: Engine, info: EngineInfo, chunk: Chunk, state_text: str, instructions: str, think: int,
                 routed: str | None) -> None:
    budget = info.max_model_len - chunk.width - think
    msgs = messages(chunk, state_text, instructions)
    if info.chat_overhead + sum(len(m["content"].encode()) for m in msgs) <= budget:
        return
    n = await engine.count_prompt(msgs)
    if n > budget:
        step = f" (the in-group read of {routed!r}, which lists every option of a group)" if routed else ""
        thought = f" + thought of {think}" if think else ""
        raise InputTooLong(f"prompt of {n} tokens + canvas of {chunk.width}{thought} exceed the model's "
                           f"{info.max_model_len}-token context{step}",
                           hint="shorten the state or ask fewer questions (or options) per node")
