"""One deterministic schemathesis run: cases drawn from operation strategies, each handed to a check."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def run_cases(strategies: Sequence[Any], examples: int, check: Callable[[Any], None]) -> float:
    """`check(case)` for `examples` cases drawn from `strategies` (derandomized, no example
    database, no deadline); returns the seconds the run took."""

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def run(case: Any) -> None:
        check(case)

    started = time.monotonic()
    run()
    return time.monotonic() - started
