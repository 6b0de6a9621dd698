"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure the API reports goes through `APIError`, so status code, error type and
body shape are decided in one place.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

# what json.loads of text a client or the model wrote may raise: malformed, or nested deeper
# than Python's parser recurses (a RecursionError, which was a 500 in three places)
JSON_ERRORS = (ValueError, RecursionError)

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "invalid_request_error",   # the console's cross-origin sign-in
    404: "invalid_request_error",   # as OpenAI types a missing model or route
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """The OpenAI error type for an HTTP status (the API's and the console's answers alike)."""
    return _TYPES.get(status, "server_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, outcome: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        # a code's Retry-After is one rule (retry_after); a caller passes headers to override it
        self.headers = headers if headers is not None else retry_after(code) or {}
        self.outcome = outcome or _default_outcome(status)

    def body(self) -> dict:
        return error_body(self.message, error_type(self.status), self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _default_outcome(status: int) -> str:
    return {400: "invalid", 401: "unauthorized", 404: "invalid", 413: "invalid", 429: "rate_limited",
            503: "not_ready"}.get(status, "error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


# kvfence_request_failures_total's code for an exception no handler expected (app.py, a bug)
INTERNAL_ERROR = "internal_error"

# how an aborted request's machine-readable code reaches the client (the codes LLMEngine.end
# is given, and the PD router's node_* codes); an unknown code is a 500
ABORT_STATUS = {
    "kv_pool_exhausted": (503, "The server cannot hold this request right now"),   # capacity: retry later
    "isolation_violation": (500, "The request was stopped by an isolation check"),
    "engine_error": (500, "The server hit an internal error on this request (other requests were not affected)"),
    "grammar_error": (500, "The response_format constraint failed during generation (other requests were not "
                           "affected)"),
    # the client's schema went past llguidance's limits only while generating (schema_check.py
    # builds the matcher and its first mask under a deadline, not every later one)
    "grammar_limit_exceeded": (400, "The structured output's schema could not be followed past the tokens "
                                    "generated so far"),
    "context_length_exceeded": (400, "A serving node refused the request"),        # PD: a node's own I4
    "kv_manifest_invalid": (500, "The KV handoff was refused"),
    "kv_transfer_failed": (503, "The KV transfer between prefill and decode failed"),
    "kv_transfer_timeout": (503, "The KV transfer between prefill and decode timed out"),
    "kv_verification_failed": (500, "The transferred KV failed verification"),
    "lease_expired": (503, "The prefill node's KV lease expired before the transfer"),
    "aborted_by_peer": (503, "The other PD node ended the request"),
    "node_failed": (503, "A PD node failed during the request"),
    "node_unavailable": (503, "A PD node is unavailable"),
    "node_error": (502, "A PD node answered with an error"),
    "server_overloaded": (503, "The server is overloaded"),
    # a single node or a router stopping (SIGTERM) past its --shutdown-timeout: retry, elsewhere
    # (server/shutdown.py)
    "server_shutting_down": (503, "The server is shutting down; retry the request"),
    # PD: a node had retired the tenant's cache scope by a reload that revoked the request's key
    # (app.py answers it as api_key_revoked before it starts; this is for one that ends later)
    "scope_retired": (401, "The API key of this request was revoked while it ran"),
}

# codes whose refusal a client may retry after a second: a node lost (the fleet routes around
# it) or the server stopping (another replica takes it). Not the capacity codes
# (kv_pool_exhausted, kv_transfer_timeout, lease_expired): a fixed second would bring every
# client back into a full pool together, where without the header the openai client backs off
# with jitter (found in review)
RETRY_SOON_CODES = frozenset({"server_overloaded", "server_shutting_down", "node_failed", "node_unavailable",
                              "aborted_by_peer", "kv_transfer_failed"})
# the server or the fleet does not serve now (loading, no node of a role ready, a node's
# drain): back in seconds, once a node has restarted and been checked
NOT_SERVING_CODES = frozenset({"engine_unavailable", "not_ready", "draining", "model_not_ready"})
# refused before any of the request ran: not a failure of the server's
# (kvfence_request_failures_total counts what it took and then failed)
NOT_TAKEN_CODES = NOT_SERVING_CODES | {"server_overloaded"}


def retry_after(code: str | None) -> dict[str, str] | None:
    """The Retry-After header a refusal with this code carries, if any."""
    if code in RETRY_SOON_CODES:
        return {"Retry-After": "1"}
    if code in NOT_SERVING_CODES:
        return {"Retry-After": "5"}
    return None


def abort_status(code: str | None) -> tuple[int, str]:
    """(HTTP status, what the client is told) for an abort code; an unknown one is a 500."""
    return ABORT_STATUS.get(code or "", (500, "The request was aborted"))


# abort codes whose detail the client may read: about its own request (its lengths, its schema),
# or the server's stop; any other detail may name a node, a transfer address, the pool's state or
# an exception, so with tenants it goes to the log and the client gets the fixed text (app.py,
# _public_detail)
OWN_DETAIL_CODES = frozenset({"grammar_error", "grammar_limit_exceeded", "context_length_exceeded", "invalid_request",
                              "server_shutting_down"})
