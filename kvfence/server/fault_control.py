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

ENV_VAR = "KVFENCE_TEST_FAULT_CONTROL"
log = logging.getLogger("kvfence.faults")


def enabled() -> bool:
    return os.environ.get(ENV_VAR) == "1"


def mount(app: FastAPI) -> None:
    if not enabled():
        return
    log.error("%s=1: this process lets tests switch fault points over HTTP (POST /internal/test/faults). "
              "NEVER SERVE REAL TRAFFIC WITH IT.", ENV_VAR)

    @app.post("/internal/test/faults")
    async def set_faults(request: Request):
        spec = str((await request.json()).get("spec", ""))
        try:
            active = faults.load_env({faults.ENV_VAR: spec})
        except faults.FaultConfigError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        if active:
            faults.announce(log)
            incidents.record("faults_active", detail="test fault points switched on over HTTP: "
                                                     + ", ".join(faults.describe()))
        return {"active": faults.describe()}
