"""The AR test server now ships as `canvasroute.apps.eval.ar_server` (`canvasroute eval` uses it);
this module keeps the tests' import path. Run it by hand: `python tests/ar_server.py --port 8081`."""

from canvasroute.apps.eval.ar_server import MAX_NEW_TOKENS, ARServer, create_app, load_smollm2, main

__all__ = ["MAX_NEW_TOKENS", "ARServer", "create_app", "load_smollm2"]

if __name__ == "__main__":
    main()
