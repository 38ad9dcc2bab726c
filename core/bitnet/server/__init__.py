"""The OpenAI-compatible HTTP server (`bitnet-select serve`, extra `bitnet-core[server]`).

`app.create_app` builds the FastAPI app over one model and its continuous-batching Scheduler;
`ray` deploys that same app as Ray Serve replicas (extra `bitnet-core[ray]`). Importing this
package imports neither FastAPI nor Ray, so the CLI can say which extra is missing.
"""

from __future__ import annotations

SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def missing_server_modules() -> list[str]:
    """The modules of the `[server]` extra that cannot be imported here."""
    from importlib.util import find_spec

    return [m for m in SERVER_MODULES if find_spec(m) is None]
