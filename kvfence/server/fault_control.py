"""Switching fault points at run time, for the tests of a running cluster.

Only a process started with KVFENCE_TEST_FAULT_CONTROL=1 has the route; it announces
itself at start-up like any enabled fault (see kvfence/faults.py). Without that variable
nothing here exists in the app, so production configuration cannot reach it.
"""
from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvfence import faults, incidents
from kvfence.pd.seal import CONTROL_HEADER, Keyring
from kvfence.server.errors import error_body

ENV_VAR = "KVFENCE_TEST_FAULT_CONTROL"
log = logging.getLogger("kvfence.faults")


def enabled() -> bool:
    return os.environ.get(ENV_VAR) == "1"


def mount(app: FastAPI, keyring: Keyring | None = None) -> None:
    """The route, when the variable is set. With a cluster secret (every PD role) it takes
    only the cluster credential, like every /internal route (I11). A node's own internal
    routes declare the check (pd/node.py); this one is mounted on the router's app too, so it
    checks for itself."""
    if not enabled():
        return
    log.error("%s=1: this process lets tests switch fault points over HTTP (POST /internal/test/faults). "
              "NEVER SERVE REAL TRAFFIC WITH IT.", ENV_VAR)

    @app.post("/internal/test/faults")
    async def set_faults(request: Request):
        if keyring is not None and not keyring.current.accepts(request.headers.get(CONTROL_HEADER)):
            return JSONResponse(error_body("internal API: missing or wrong cluster credential",
                                           "authentication_error", None, "unauthorized"), status_code=401)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": 'send {"spec": "point:action,..."}'}, status_code=400)
        spec = body.get("spec", "")
        if not isinstance(spec, str):   # null was read as the fault named 'None'
            return JSONResponse({"error": '"spec" is a string: "point:action,..." ("" for none)'}, status_code=400)
        try:
            active = faults.load_env({faults.ENV_VAR: spec})
        except faults.FaultConfigError as e:   # it quotes the spec: a bound on what is echoed
            return JSONResponse({"error": str(e)[:1000]}, status_code=400)
        if active:
            faults.announce(log)
            faults.record_active("switched on over HTTP")
        else:   # the report's window of unchecked operation ends here
            incidents.record("faults_cleared", detail="test fault points switched off over HTTP")
        return {"active": faults.describe()}
