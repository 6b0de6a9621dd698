"""The operator console: GET /console, a static page whose script reads
GET /v1/kvfence/console (and GET /v1/kvfence/incidents) every few seconds.

Who gets in: only the operator, by the `[operator]` key of the tenants file, never a
tenant's key. A client sends it as `Authorization: Bearer <key>`; a browser posts it once
to /console/login (a form, so the key is in a request body, never in a URL) and gets an
HttpOnly, SameSite=Strict cookie holding `expiry.HMAC(process secret, SHA-256(key) ||
expiry)`: the key itself is not in it, it dies with the process (a new secret per boot)
and after SESSION_S. Without an operator key in the tenants file every route here answers
404 and says how to add one.

What others learn: an unauthenticated request gets 401 and, on /console, the sign-in form
and nothing else (no model, no tenant, no version); a tenant's key gets the same 401. Every
response carries a Content-Security-Policy that allows only this origin's own script and
style (no inline script: the page has none), X-Frame-Options: DENY and Cache-Control:
no-store. The script builds the page with textContent only, so nothing it shows (tenant
names, incident details) can become markup. Guessing is bounded: 30 failed sign-ins from one
address within a minute, and that address gets 429 on these routes for the rest of it
(server/auth_throttle.py).
"""
from __future__ import annotations

import hashlib
import hmac
import html
import secrets
import time
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from kvfence.server.auth_throttle import client_address
from kvfence.server.console_view import console_view, incidents_view
from kvfence.server.errors import error_body, error_type
from kvfence.server.tenants import TenantsFileError

if TYPE_CHECKING:
    from kvfence.server.app import ServerState
    from kvfence.server.tenants import TenantRegistry

COOKIE = "kvfence_console"
SESSION_S = 12 * 3600
MAX_LOGIN_BODY = 4096
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # not no-referrer: with it Chromium sends "Origin: null" on the sign-in post, which then
    # cannot be told from a cross-site one; same-origin still sends nothing to another site
    "Referrer-Policy": "same-origin",
}
NOT_CONFIGURED = ("The operator console is off: this server has no operator key. Add an [operator] table to the "
                  "tenants file (--tenants FILE) with api_keys = [\"<key>\"] or api_key_sha256 = [\"<hex digest>\"], "
                  "then restart the server (one started with that tenants file also reloads it on SIGHUP).")

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvfence operator console</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/console/login.css"></head>
<body class="login"><main>
<h1>kvfence operator console</h1>
<form method="post" action="/console/login">
<label for="key">Operator key</label>
<input id="key" name="key" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Sign in</button>
</form>
<p class="msg">{message}</p>
</main></body></html>
"""
_MESSAGES = {"none": "Sign in with the operator key from the tenants file's [operator] table.",
             "wrong": "That is not the operator key."}   # fixed strings: nothing from the request is echoed

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvfence operator console</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/console/console.css">
<script src="/console/console.js" defer></script></head>
<body>
<header><h1>kvfence operator console</h1><span id="status">loading...</span>
<form method="post" action="/console/logout"><button type="submit">Sign out</button></form></header>
<main>
<section id="nodes-section"><h2>Nodes and their checks</h2><div id="nodes"></div></section>
<section id="pools-section"><h2>KV pool map</h2>
<p class="note">One cell per page (or per group of pages on a large pool), grouped by state, not by address:
counts and owners only, never content.</p><div id="pools"></div></section>
<section id="requests-section"><h2>Requests and rejections</h2><div id="tenants"></div><div id="requests"></div>
</section>
<section id="incidents-section"><h2>Incident log, newest first</h2><p class="note" id="incidents-note"></p>
<div id="incidents"></div></section>
<section id="isolation-section"><h2>Isolation statement</h2><div id="isolation"></div></section>
</main></body></html>
"""


class OperatorAuth:
    """The operator key (TenantRegistry.is_operator) or a console cookie made from it."""

    def __init__(self, state: ServerState):
        self._state = state
        self._secret = secrets.token_bytes(32)
        self.throttle = state.key_throttle   # one count with /metrics' and the statement's key checks

    @property
    def tenants(self) -> TenantRegistry:
        """The registry in force: after a reload that changed the operator key, the old key
        and the cookies signed for it stop working at once."""
        return self._state.tenants

    @property
    def configured(self) -> bool:
        return bool(self.tenants.operator_digests)

    def _mac(self, digest: bytes, expires: int) -> str:
        return hmac.new(self._secret, digest + str(expires).encode(), hashlib.sha256).hexdigest()

    def cookie_for(self, key: str) -> str | None:
        """The cookie value for `key` if it is the operator's, else None."""
        if not self.tenants.is_operator(f"Bearer {key}"):
            return None
        key = key.strip()   # as is_operator reads it: a pasted key with a space signed a cookie nobody matched
        expires = int(time.time()) + SESSION_S
        return f"{expires}.{self._mac(hashlib.sha256(key.encode('utf-8', 'surrogatepass')).digest(), expires)}"

    def _cookie_ok(self, value: str | None) -> bool:
        if not value:
            return False
        exp, _, mac = value.partition(".")
        if not (exp.isascii() and exp.isdigit()) or len(exp) > 12 or int(exp) < time.time():   # '²' isdigit
            return False
        found = False
        for d in self.tenants.operator_digests:     # every digest, no early exit
            found |= hmac.compare_digest(mac.encode(), self._mac(d, int(exp)).encode())
        return found

    def end_sessions(self) -> None:
        """Sign every console session out: the cookie is stateless, so its signing key changes
        (found in review: signing out cleared the browser's cookie, and a copy of it kept
        working for the rest of its 12 hours)."""
        self._secret = secrets.token_bytes(32)

    def allows(self, request: Request, cookie: bool = True) -> bool:
        """The operator's key in the header, or (`cookie`) a console cookie made from it."""
        return self.tenants.is_operator(request.headers.get("authorization")) or \
            (cookie and self._cookie_ok(request.cookies.get(COOKIE)))


def _asset(name: str) -> str:
    return resources.files("kvfence.server").joinpath("console_static", name).read_text(encoding="utf-8")


def _secure(resp: Response) -> Response:
    resp.headers.update(SECURITY_HEADERS)
    return resp


def _json_error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="kvfence operator"'
    return _secure(JSONResponse(error_body(message, error_type(status), None, code), status_code=status,
                                headers=headers))


def _throttled(auth: OperatorAuth, request: Request) -> Response | None:
    wait = auth.throttle.retry_after(client_address(request))
    if wait is None:
        return None
    return _json_error(429, f"Too many failed operator sign-ins from this address; try again in {wait} s.",
                       "too_many_failed_sign_ins", {"Retry-After": str(wait)})


def _refused_guess(auth: OperatorAuth, request: Request, cookie: bool = True) -> bool:
    """True (and counted) when the request offered a key that is not the operator's. A bad
    cookie is not counted: its HMAC cannot be guessed, and after a restart (a new secret)
    every open console tab would count against its own address."""
    if auth.allows(request, cookie):
        return False
    if "authorization" in request.headers:
        auth.throttle.failed(client_address(request))
    return True


def _login_page(status: int, message: str = "none") -> Response:
    return _secure(HTMLResponse(_LOGIN.format(message=_MESSAGES[message]), status_code=status,
                                headers={"WWW-Authenticate": 'Bearer realm="kvfence operator"'}))


def _same_origin(request: Request) -> bool:
    """A form post from this page's own origin (or a client that sends no Origin)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


def mount(app: FastAPI, state: ServerState) -> None:
    auth = OperatorAuth(state)
    assets = {"console.js": ("application/javascript", _asset("console.js")),
              "console.css": ("text/css", _asset("console.css")), "login.css": ("text/css", _asset("login.css"))}

    def refused(request: Request, cookie: bool = True,
                need: str = "The operator console needs the operator key (never a tenant's): send "
                            "'Authorization: Bearer <operator key>' or sign in at /console.") -> Response | None:
        if not auth.configured:
            return _json_error(404, NOT_CONFIGURED, "operator_not_configured")
        if (slow := _throttled(auth, request)) is not None:
            return slow
        if _refused_guess(auth, request, cookie):
            return _json_error(401, need, "invalid_operator_key")
        return None

    @app.get("/console")
    async def console(request: Request):
        if not auth.configured:
            return _secure(HTMLResponse(f"<!doctype html><title>kvfence</title><p>{html.escape(NOT_CONFIGURED)}</p>",
                                        status_code=404))
        if (slow := _throttled(auth, request)) is not None:
            return slow
        if _refused_guess(auth, request):
            return _login_page(401)
        return _secure(HTMLResponse(_PAGE))

    @app.get("/console/")
    async def console_slash():
        # what people type; a relative Location (not one built from the Host header)
        return _secure(RedirectResponse("/console", status_code=308))

    @app.get("/console/login.css")
    async def login_css():
        kind, text = assets["login.css"]    # the sign-in form's style: public, like the form
        return _secure(Response(text, media_type=kind))

    @app.get("/console/{name}")
    async def asset(name: str, request: Request):
        if name not in ("console.js", "console.css"):
            return _json_error(404, f"No route GET {request.url.path}.", "not_found")
        no = refused(request)
        if no is not None:
            return no
        kind, text = assets[name]
        return _secure(Response(text, media_type=kind))

    @app.post("/console/login")
    async def login(request: Request):
        if not auth.configured:
            return _json_error(404, NOT_CONFIGURED, "operator_not_configured")
        if not _same_origin(request):
            return _json_error(403, "Cross-origin sign-in refused.", "cross_origin")
        if (slow := _throttled(auth, request)) is not None:
            return slow
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return _json_error(413, "Sign-in form too large.", "request_too_large")
        try:
            key = (parse_qs(body.decode("utf-8", "replace"), max_num_fields=4).get("key") or [""])[0]
        except ValueError:   # more fields than the form has: not a sign-in, and no 500
            return _json_error(400, "Sign-in form has too many fields; send only key=...", "invalid_form")
        if (slow := _throttled(auth, request)) is not None:
            return slow   # again: many connections may have passed the first check before any body came
        value = auth.cookie_for(key) if key else None
        if value is None:
            auth.throttle.failed(client_address(request))
            return _login_page(401, "wrong")
        resp = RedirectResponse("/console", status_code=303)
        resp.set_cookie(COOKIE, value, max_age=SESSION_S, path="/", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return _secure(resp)

    @app.post("/console/logout")
    async def logout(request: Request):
        if not _same_origin(request):   # another site's form signed the operator out
            return _json_error(403, "Cross-origin sign-out refused.", "cross_origin")
        if auth.allows(request):   # a signed-in session's own request (never another site's: SameSite)
            auth.end_sessions()
        resp = RedirectResponse("/console", status_code=303)
        resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return _secure(resp)

    @app.post("/v1/kvfence/tenants/reload")
    async def reload_tenants(request: Request):
        # the key in the header only, never the console's cookie: a cookie rides along on a
        # request another site makes the browser send
        if state.tenants.single_tenant:   # the console's own 404 told how to add an operator key
            return _json_error(404, "This server has no tenants file to reload: it was started without --tenants "
                                    "(single-tenant mode); restart it with --tenants FILE.", "no_tenants_file")
        no = refused(request, cookie=False, need="Reloading the tenants file needs the operator key (never a "
                                                 "tenant's): send 'Authorization: Bearer <operator key>'.")
        if no is not None:
            return no
        try:
            change = await state.reload_tenants("POST /v1/kvfence/tenants/reload")
        except TenantsFileError as e:
            return _json_error(400, f"The tenants file was not reloaded, the previous one stays in force: {e}",
                               "invalid_tenants_file")
        return _secure(JSONResponse({"reloaded": True, **change}))

    @app.get("/v1/kvfence/console")
    async def console_json(request: Request):
        no = refused(request)
        return no if no is not None else _secure(JSONResponse(console_view(state)))

    @app.get("/v1/kvfence/incidents")
    async def incidents_json(request: Request):
        no = refused(request)
        return no if no is not None else _secure(JSONResponse(incidents_view()))
