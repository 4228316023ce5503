"""Run the real web calculator and look at it in headless Chromium: the end-to-end test
(``tests/webapp/test_e2e.py``) and the README's screenshots (``scripts/screenshots.py``) use this.

The server is ``streamlit run app.py`` on a free local port; the browser is the Debian
``chromium`` package (``/usr/bin/chromium``) driven by Playwright (``pip install
'.[e2e]'``), which downloads no browser of its own. Chromium runs headless, without sandbox,
GPU, background networking, component updates or sync, in a fresh profile.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path(os.environ.get("VRAMPLAN_CHROMIUM", "/usr/bin/chromium"))
"""The browser binary (Debian's ``chromium`` package)."""
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
VERDICT = "^(fits with|does not fit:) "
"""A regular expression matching the verdict sentence."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(timeout_s: float = 60.0) -> Iterator[str]:
    """``streamlit run app.py`` on a free port; yields its base URL once ``/_stcore/health``
    answers, and stops it on exit."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"),
        "--server.headless", "true", "--server.port", str(port),
        "--server.address", "127.0.0.1", "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
    ]  # fmt: skip
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                out = log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"streamlit did not start (exit {proc.poll()}):\n{out}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[object]:
    """A Playwright page in headless Debian Chromium with a fresh profile."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="vramplan-chromium-") as profile:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile,
                executable_path=str(CHROMIUM),
                headless=True,
                args=list(CHROMIUM_ARGS),
                viewport={"width": width, "height": height},
            )
            try:
                yield context.new_page()
            finally:
                context.close()


def load(page: object, url: str, wait_for: str, timeout_s: float = 90.0) -> None:
    """Open ``url`` and wait until a text matching the regular expression ``wait_for`` is shown
    and Streamlit is idle."""
    page.goto(url, wait_until="domcontentloaded")  # type: ignore[attr-defined]
    shown = page.get_by_text(re.compile(wait_for)).first  # type: ignore[attr-defined]
    shown.wait_for(timeout=timeout_s * 1000)
    # Streamlit marks the app "running" while a script run is in flight.
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
        timeout=timeout_s * 1000,
    )
    page.wait_for_timeout(1500)  # type: ignore[attr-defined]  # charts draw after the data


def verdict_text(page: object) -> str:
    """The verdict sentence: the line of an alert box (success or error) that starts with
    ``fits with`` or ``does not fit:`` (the box's other line is its icon's name)."""
    alerts = page.locator('[data-testid="stAlert"]').all_inner_texts()  # type: ignore[attr-defined]
    lines = [line.strip() for alert in alerts for line in alert.splitlines()]
    hits = [line for line in lines if re.match(VERDICT, line)]
    if not hits:
        raise AssertionError(f"no verdict among the alerts: {alerts}")
    return hits[0]
