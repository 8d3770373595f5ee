"""The dashboard page in headless Chromium, driven over the DevTools protocol (aiohttp's websocket client):
it loads without console errors, draws the reward curve, the viewer opens a trajectory of the short run, and
the curves of a running run take rows appended to its metrics.jsonl.

Chromium: Debian's `chromium` package. Where it is missing and this runs as root with apt (CI's fresh box),
the test installs it (about 30 s); otherwise it skips saying what to install. With
AGENTRL_DASHBOARD_SCREENSHOTS=DIR it also saves the screenshots docs/observability.md shows.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from agentrl.dashboard.server import Dashboard
from agentrl.net import free_port
from agentrl.runlayout import RUN_LOCK
from agentrl.runlock import DirLock
from tests.dashboard_support import short_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WAIT_S = 60.0  # an upper bound for a slow shared box, not a speed check

pytestmark = pytest.mark.slow  # one short real `agentrl run` per session (tests/dashboard_support.py)


def chromium() -> str:
    found = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        for step in (["install"], ["update"], ["install"]):  # a fresh box has no package lists yet
            out = subprocess.run(["apt-get", *step, "-y", "-q", *(["chromium"] if step == ["install"] else [])],
                                 capture_output=True, timeout=600)  # fmt: skip
            if step == ["install"] and out.returncode == 0:
                break
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("headless Chromium not found: install Debian's chromium (apt-get install -y chromium)")
    return found


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, run_model):
    return short_run(tmp_path_factory, run_model)


class Page:
    """One browser tab over CDP; console errors and uncaught exceptions are collected in `errors`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws, self.n, self.errors = ws, 0, []

    async def call(self, method: str, **params):
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=WAIT_S)
            if msg.get("id") == self.n:
                assert "error" not in msg, msg
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict) -> None:
        p = msg.get("params", {})
        if msg.get("method") == "Runtime.exceptionThrown":
            self.errors.append(p["exceptionDetails"].get("exception", {}).get("description", str(p)))
        elif msg.get("method") == "Runtime.consoleAPICalled" and p.get("type") == "error":
            self.errors.append(str([a.get("value", a.get("description")) for a in p.get("args", [])]))
        elif msg.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
            self.errors.append(p["entry"].get("text", "") + " " + p["entry"].get("url", ""))

    async def js(self, expression: str):
        out = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        assert "exceptionDetails" not in out, out
        return out["result"].get("value")

    async def until(self, expression: str):
        for _ in range(int(WAIT_S * 10)):
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f"never true: {expression}; console errors: {self.errors}")

    async def screenshot(self, name: str) -> None:
        target = os.environ.get("AGENTRL_DASHBOARD_SCREENSHOTS")
        if target:
            shot = await self.call("Page.captureScreenshot", format="png")
            Path(target).mkdir(parents=True, exist_ok=True)
            (Path(target) / name).write_bytes(base64.b64decode(shot["data"]))


async def test_the_page_draws_the_reward_curve_and_opens_a_trajectory(run_dir, tmp_path):
    browser = chromium()
    board = Dashboard(run_dir, token="page-token")  # the page must forward the token to every call
    url = await board.start()
    live = tmp_path / "live"
    shutil.copytree(run_dir, live, ignore=shutil.ignore_patterns("checkpoints", "summary.json"))
    lock = DirLock(live / RUN_LOCK, "run directory").acquire()  # as the driver of `agentrl run` does
    live_board = Dashboard(live)
    live_url = await live_board.start()
    port = free_port()
    proc = subprocess.Popen(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--remote-debugging-port={port}", "--remote-allow-origins=*", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1200,820", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(int(WAIT_S * 10)):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                        tabs = [t for t in await r.json() if t["type"] == "page"]
                    if tabs:
                        break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            async with http.ws_connect(tabs[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                for domain in ("Runtime", "Log", "Page"):
                    await page.call(f"{domain}.enable")
                await page.call("Emulation.setDeviceMetricsOverride", width=1200, height=820,
                                deviceScaleFactor=1, mobile=False)  # fmt: skip
                await page.call("Page.navigate", url=url)
                assert await page.until(
                    "Number(document.getElementById('chart-reward')?.dataset.points) >= 4"
                )
                assert await page.js("document.getElementById('run-state').textContent") == "finished"
                await page.screenshot("dashboard.png")

                await page.js("location.hash = 'trajectories?step=4'")
                assert await page.until("document.querySelectorAll('#traj-list .traj').length") == 8
                await page.js("document.querySelector('#traj-list .traj').click()")
                assert await page.until("document.querySelectorAll('#traj-detail .tok').length") > 0
                title = await page.js("document.querySelector('#traj-detail h3').textContent")
                assert title.startswith("t") and "-s" in title
                assert await page.js(
                    "document.querySelector('#traj-detail .turn.assistant .tok.m1') !== null"
                )
                await page.js("document.getElementById('f-versions').click()")  # per-token version stamps
                assert await page.until("document.querySelectorAll('#traj-detail sub.ver').length") > 0
                await page.screenshot("viewer.png")

                # a running run (its driver holds run.lock): the curves take new metrics rows as they come
                await page.call("Page.navigate", url=live_url)
                assert await page.until(
                    "Number(document.getElementById('chart-reward')?.dataset.points) >= 4"
                )
                assert await page.js("document.getElementById('run-state').textContent") == "running"
                with (live / "metrics.jsonl").open("a") as f:
                    f.write(
                        json.dumps({"step": 5, "reward_mean": 0.5, "policy_version": 5, "wall_s": 40.0})
                        + "\n"
                    )
                assert await page.until("Number(document.getElementById('chart-reward').dataset.points) >= 5")
                assert page.errors == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        await board.close()
        await live_board.close()
        lock.release()
