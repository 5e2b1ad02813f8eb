"""A headless Chromium driven over its DevTools pipe: what the dashboard's browser test and its
screenshot command run (no WebDriver, no websocket client: `--remote-debugging-pipe` speaks the
DevTools protocol as NUL-terminated JSON on file descriptors 3 and 4).

    with Browser.start() as browser:
        browser.open("http://127.0.0.1:8000/dashboard")
        browser.wait_for("document.querySelectorAll('g.step').length > 0")
        browser.screenshot("dashboard.png")
    browser.errors  # what the page logged as errors, and its uncaught exceptions

Chromium is Debian's `chromium` package (or `CHUNKSERVE_CHROMIUM` names the binary).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

COMMAND_TIMEOUT_S = 30.0


def chromium_path() -> str | None:
    """The Chromium binary: $CHUNKSERVE_CHROMIUM, else `chromium` or `chromium-browser` on PATH."""
    named = os.environ.get("CHUNKSERVE_CHROMIUM")
    if named:
        return named
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, process: subprocess.Popen, to_browser: int, from_browser: int, profile: str) -> None:
        self.process = process
        self._to = to_browser
        self._from = from_browser
        self._profile = profile
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.errors: list[str] = []  # console errors and uncaught exceptions, as the page reported them
        self.console: list[str] = []
        self._session: str | None = None
        threading.Thread(target=self._read, name="chromium-devtools", daemon=True).start()

    @classmethod
    def start(cls, width: int = 1400, height: int = 1000) -> Browser:
        binary = chromium_path()
        if binary is None:
            raise BrowserError("no Chromium found: install Debian's `chromium` package (apt-get install chromium) "
                               "or set CHUNKSERVE_CHROMIUM")
        to_read, to_write = os.pipe()  # we write commands, Chromium reads them on its fd 3
        from_read, from_write = os.pipe()  # Chromium writes on its fd 4, we read
        profile = tempfile.mkdtemp(prefix="chunkserve-chromium-")

        def pipes_as_fds_3_and_4() -> None:  # (in the child: copies above both first, as either may be 3 or 4)
            reading, writing = os.dup(to_read), os.dup(from_write)
            os.dup2(reading, 3)
            os.dup2(writing, 4)  # (dup2 makes them inheritable; Python opens its own descriptors non-inheritable)

        process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-extensions", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"],
            preexec_fn=pipes_as_fds_3_and_4, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_read)
        os.close(from_write)
        browser = cls(process, to_write, from_read, profile)
        try:
            browser._attach()
        except BaseException:
            browser.close()
            raise
        return browser

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    # ----- the protocol ------------------------------------------------------------------------------

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                self._dispatch(json.loads(raw))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            with self._lock:
                waiting = self._replies.pop(message["id"], None)
            if waiting is not None:
                waiting.put(message)
            return
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                self.errors.append(f"console.{params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True) -> dict[str, Any]:
        """One DevTools command (on the page's session unless `session` is False); its result."""
        message_id = next(self._ids)
        reply: queue.Queue = queue.Queue(maxsize=1)
        with self._lock:
            self._replies[message_id] = reply
        message = {"id": message_id, "method": method, "params": params or {}}
        if session and self._session is not None:
            message["sessionId"] = self._session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        try:
            answer = reply.get(timeout=COMMAND_TIMEOUT_S)
        except queue.Empty:
            raise BrowserError(f"Chromium did not answer {method} within {COMMAND_TIMEOUT_S:g} s") from None
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error'].get('message')}")
        return answer.get("result", {})

    def _attach(self) -> None:
        targets = self.send("Target.getTargets", session=False)["targetInfos"]
        page = next((t for t in targets if t["type"] == "page"), None)
        target = page["targetId"] if page else self.send("Target.createTarget", {"url": "about:blank"},
                                                          session=False)["targetId"]
        self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                  session=False)["sessionId"]
        for domain in ("Runtime", "Page", "Log"):
            self.send(f"{domain}.enable")

    # ----- what a test does ------------------------------------------------------------------------

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0, poll_s: float = 0.1) -> Any:
        """Evaluate `expression` until it is truthy; its value (a BrowserError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression!r} was still {value!r} after {timeout_s:g} s")
            time.sleep(poll_s)

    def screenshot(self, path: str) -> str:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self) -> None:
        if self.process.poll() is None:
            try:  # (no answer is awaited: the process ends instead)
                os.write(self._to, json.dumps({"id": next(self._ids), "method": "Browser.close"}).encode() + b"\0")
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for fd in (self._to, self._from):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)
