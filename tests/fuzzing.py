"""One deterministic schemathesis run: cases drawn from operation strategies, each handed to a check.

Importing this applies schemathesis's own patches to Hypothesis and hypothesis-jsonschema (speed:
canonical JSON in Rust, cached reflection), which its pytest plugin and CLI apply but
`operation.as_strategy` does not: without them a run in a plain process (a background job,
tests/background.py) draws other cases, and `/v1/decisions`' 300 took 400 s instead of 11. The
cases also follow the process's hash seed (hypothesis-jsonschema walks sets of names): the
background jobs pin it (`background.JOB_HASH_SEED`), so each run draws the same cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.hypothesis import setup

from canvasroute.apps.server.limits import ConnectionLimits

setup()  # idempotent

PATIENT = ConnectionLimits(head_timeout=300.0, keep_alive=300.0)
"""The connection bounds a fuzzed server runs with. A run is a background job at nice 19 (and its
server a thread of it): starved beside the suite, the client can pause past the default 5 s
keep-alive between two requests, and the server closing the idle connection just as the client
reuses it resets it (seen once in CI: `ConnectionResetError` on a request the server answers 422).
That is the race of an idle connection, not a fault of the server, whose own timeouts
tests/test_server_hostile.py checks."""
REQUEST_S = 300.0
"""A fuzzed server's `request_timeout`; its client waits a minute more. Starved at nice 19, a request that
takes milliseconds of CPU may take any wall time, and a 504 would read as a fault the engine did not raise:
the job's `Watch` (tests/background.py: CPU-seconds used, seconds all blocked) is what says it is stuck."""
CLIENT_S = REQUEST_S + 60
"""The fuzzing client's timeout per request."""


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
