"""Headless Chromium (Debian's package) driven over the Chrome DevTools Protocol, with the
websocket client of aiohttp (already a dependency): navigate, run a script in the page,
read cookies, take a screenshot. Every wait is bounded.

Without a browser the tests that need one skip on a developer machine and fail in CI (the
CI variable set): `scripts/setup.sh --test` installs it as root on Debian.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
from required_tools import tool_or_skip

NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_or_skip() -> str:
    return tool_or_skip(*NAMES, purpose="the console's browser test", install="apt-get install chromium")


class Browser:
    """One Chromium process with one page. Use as `async with Browser(exe, dir) as b:`."""

    def __init__(self, exe: str, workdir: Path, width: int = 1400, height: int = 1000):
        self.exe, self.dir, self.size = exe, workdir, (width, height)
        self.proc: subprocess.Popen | None = None
        self.events: list[dict] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def __aenter__(self) -> Browser:
        profile = self.dir / "profile"
        profile.mkdir(parents=True, exist_ok=True)
        self._log = open(self.dir / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [self.exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--disable-component-update", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={profile}", f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=self._log)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"chromium did not start: {(self.dir / 'chromium.log').read_text()[-2000:]}")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as r:
            targets = await r.json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Network", "Log"):
            await self.send(f"{domain}.enable")
        return self

    async def __aexit__(self, *exc) -> None:
        self._reader.cancel()
        await self._ws.close()
        await self._http.close()
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    async def _read(self) -> None:
        async for msg in self._ws:
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None:
                fut.set_result(data)
            elif "method" in data:
                self.events.append(data)

    async def send(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        await self._ws.send_str(json.dumps({"id": i, "method": method, "params": params or {}}))
        reply = await asyncio.wait_for(fut, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete' && location.href === " + json.dumps(url))

    async def eval(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                 "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                v = await self.eval(expression)
            except RuntimeError:   # the page is between documents
                v = None
            if v:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true within {timeout} s: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> Path:
        r = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(r["data"]))
        return path

    def messages(self) -> list[str]:
        """Console messages, log entries and uncaught exceptions, as text."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Log.entryAdded":
                out.append(f"{p['entry'].get('level')}: {p['entry'].get('text')}")
            elif e["method"] == "Runtime.consoleAPICalled":
                out.append(f"console.{p.get('type')}: " + " ".join(str(a.get("value")) for a in p.get("args", [])))
            elif e["method"] == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:500])
        return out
