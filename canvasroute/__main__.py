"""`python -m canvasroute ...` is the `canvasroute` command."""

from canvasroute.apps.cli import main

raise SystemExit(main())
