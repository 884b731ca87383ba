"""A real server for the DiLoCo page's API tests: the page's FastAPI app at /diloco and the
configured auth manager's app at /auth (POST /auth/token), on Airflow's own auth manager and a
migrated metadata DB of a private AIRFLOW_HOME (the caller sets the environment).

    python tests/ui_server.py PORT STORE_URL [STORE_URL ...]
"""

from __future__ import annotations

import sys


def main() -> None:
    import uvicorn
    from airflow.api_fastapi.app import init_auth_manager
    from diloco_airflow.ui.api import create_app
    from diloco_airflow.ui.sources import StaticSource
    from fastapi import FastAPI

    port, stores = int(sys.argv[1]), sys.argv[2:]
    app = FastAPI()
    app.mount("/diloco", create_app(StaticSource(stores)))
    init_auth_manager(app)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
