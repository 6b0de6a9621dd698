"""The two clients a stopping server must answer, shared by the single node's and the router's
shutdown tests: one streaming and one waiting for its whole answer, each on its own thread,
both asking for far more tokens than the shutdown timeout lets run."""
from __future__ import annotations

import json
import threading

import httpx


def status(url: str) -> int:
    """/health's status code, or 0 when nothing answers."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


class LongClients:
    def __init__(self, url: str, body: dict) -> None:
        self.got: dict = {}
        self._threads = [threading.Thread(target=self._stream, args=(url, body)),
                         threading.Thread(target=self._plain, args=(url, body))]

    def start(self) -> LongClients:
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _stream(self, url: str, body: dict) -> None:
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        self.got["stream"] = events

    def _plain(self, url: str, body: dict) -> None:
        self.got["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    def assert_ended_by_shutdown(self, why: str) -> None:
        """The stream had its tokens until the deadline, then the reason, then [DONE]; the plain
        request a 503 server_shutting_down that asks to come back in a second."""
        events = self.got["stream"]
        assert events[-1] == "[DONE]" and len(events) > 3, events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and why in error["message"], error
        r = self.got["plain"]
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.headers, r.text)
        assert r.json()["error"]["code"] == "server_shutting_down", r.text
