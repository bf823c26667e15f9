"""Support-ticket triage: team, urgency and severity in ONE canvas read, then route.

```
START -> triage -.-> billing | technical | account | on_call -> END
```

The graph ships with the package as `canvasroute.apps.demo.triage` (it is what `canvasroute demo`
runs); this script runs it. Run it: `python -m examples.triage [vLLM URL]`.
"""

from __future__ import annotations

import sys

from canvasroute.apps.demo.triage import (
    QUESTIONS,
    SAMPLE_TICKETS,
    TEAMS,
    TicketState,
    build_graph,
    main,
    route,
    run_samples,
)

__all__ = ["QUESTIONS", "SAMPLE_TICKETS", "TEAMS", "TicketState", "build_graph", "main", "route", "run_samples"]

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
