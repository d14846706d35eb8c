"""The dashboard in a real browser (headless Debian chromium, driven by Playwright) against a real
cluster: two ``tensorwire serve`` slots, the first with a standby. The page loads with no console
error and shows both slots up; a worker trains a few steps (the jobs and traffic panels fill); the
first slot's primary is killed (-9) and the page shows the failover (the backup primary, the
epoch up, a timeline entry) within a few seconds. A screenshot lands in the test's temp dir (and
at ``$TENSORWIRE_DASHBOARD_PNG`` when set: ``docs/img/dashboard.png`` was made so).

Skipped, saying why, without chromium (``$TENSORWIRE_CHROMIUM`` or ``chromium`` on the PATH) or
Playwright; ``.ci/run`` installs chromium.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")

from dashboard_kit import DashboardProcess  # noqa: E402

from tensorwire.ps import SGD, Worker  # noqa: E402
from tensorwire.security import write_token_file  # noqa: E402
from tensorwire.testing.faults import kill9  # noqa: E402
from tensorwire.testing.process import ServerProcess, wait_for  # noqa: E402

CHROMIUM = (
    os.environ.get("TENSORWIRE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
)
SHOWN_WITHIN = 20_000  # ms from the kill to the failover on the page (failover timeout 1 s; a loaded CI)


# The first slot's primary is the backup, at a higher epoch, and the timeline says so.
FAILED_OVER = """([backup, epoch]) => {
    const slot = document.querySelector(".slot[data-slot='0']");
    return slot !== null && slot.dataset.primary === backup && Number(slot.dataset.epoch) > epoch
        && document.querySelector("#timeline li[data-kind='failover']") !== null;
}"""


BACKUP_IN_SYNC = """(backup) => {
    const lag = document.querySelector(`.replica[data-url='${backup}'] .why`);
    return lag !== null && lag.textContent.startsWith("primary");
}"""


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no chromium (apt-get install chromium, or set TENSORWIRE_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI and this machine run tests as root, where chromium's sandbox cannot start.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


class Training:
    """A worker training a small model over both slots in a thread until ``stop``: a job, traffic
    and staleness to show, and the requests that make the backup take over (a standby promotes
    itself when a worker asks it after the primary went silent)."""

    def __init__(self, urls: list[str]) -> None:
        self.steps = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(urls,), name="dashboard-test-worker")
        self._thread.start()

    def _run(self, urls: list[str]) -> None:
        try:
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
            with Worker(net, urls, "async", SGD(lr=0.05), rank=0, timeout=30, heartbeat=0.2) as worker:
                while not self._stop.is_set():
                    x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
                    torch.nn.functional.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
                    worker.step()
                    self.steps += 1
                    self._stop.wait(0.02)  # a paced job: the page shows a rate, the 2 cores stay shared
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the worker did not stop"


def shown(
    page: Any, dashboard: DashboardProcess, what: str, js: str, *, arg: Any = None, timeout: int = 15_000
) -> None:
    """Wait until ``js`` holds on the page; else fail with what the dashboard was serving."""
    try:
        page.wait_for_function(js, arg=arg, timeout=timeout)
    except sync_api.TimeoutError:
        with urllib.request.urlopen(dashboard.url + "api/snapshot", timeout=5) as answer:
            served = answer.read().decode()
        raise AssertionError(
            f"the page did not show {what} within {timeout} ms; the dashboard served {served}"
        ) from None


def test_the_page_shows_both_slots_then_the_failover(browser: Any, tmp_path: Path) -> None:
    peer = ["--peer-token-file", str(write_token_file(tmp_path / "peer.token"))]
    metrics = ["--metrics-port", "0"]
    with (
        ServerProcess(extra=["--standby", "--failover-timeout", "1", *peer, *metrics]) as backup,
        ServerProcess(extra=["--backup", backup.url, *peer, *metrics]) as primary,
        ServerProcess(extra=metrics) as other,
    ):
        slot0 = f"{primary.url}|{backup.url}"
        with DashboardProcess([slot0, other.url], ["--interval", "0.5", "--timeout", "2"]) as dashboard:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems: list[str] = []
            page.on(
                "console",
                lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(dashboard.url)
            both_up = "() => document.querySelectorAll('.slot:not(.failed)').length === 2"
            shown(page, dashboard, "both slots up", both_up)
            primaries = page.eval_on_selector_all(".slot", "els => els.map(e => e.dataset.primary)")
            assert primaries == [primary.url, other.url]
            epoch = int(page.get_attribute(".slot[data-slot='0']", "data-epoch") or 0)
            training = Training([slot0, other.url])
            try:
                shown(
                    page, dashboard, "the job", "() => document.querySelectorAll('#jobs tbody tr').length > 0"
                )
                # A standby takes over only once it has heard from its primary (a backup that never
                # synced holds no state to serve): its row says since when ("primary 0.2s ago").
                shown(page, dashboard, "the backup in sync", BACKUP_IN_SYNC, arg=backup.url)
                kill9(primary.proc)()
                killed = time.monotonic()
                shown(
                    page,
                    dashboard,
                    "the failover",
                    FAILED_OVER,
                    arg=[backup.url, epoch],
                    timeout=SHOWN_WITHIN,
                )
                shown_after = time.monotonic() - killed
                steps = training.steps
                wait_for(
                    lambda: training.steps > steps + 5 or bool(training.errors), 30, "steps on the backup"
                )
                # while the job trains on the new primary: its rates are on the page
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            finally:
                training.stop()
            down = page.inner_text(f".replica[data-url='{primary.url}']")
            if os.environ.get("TENSORWIRE_DASHBOARD_PNG"):
                shutil.copy(tmp_path / "dashboard.png", os.environ["TENSORWIRE_DASHBOARD_PNG"])
            page.close()
    assert training.errors == [], training.errors
    assert "DOWN" in down, down  # the killed primary is shown down, with why
    assert shown_after < SHOWN_WITHIN / 1000
    assert problems == [], problems
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
