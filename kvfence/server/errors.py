"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure the API reports goes through `APIError`, so status code, error type and
body shape are decided in one place.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, outcome: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}
        self.outcome = outcome or _default_outcome(status)

    def body(self) -> dict:
        return error_body(self.message, _TYPES.get(self.status, "server_error"), self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _default_outcome(status: int) -> str:
    return {400: "invalid", 401: "unauthorized", 404: "invalid", 413: "invalid", 429: "rate_limited",
            503: "not_ready"}.get(status, "error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)
