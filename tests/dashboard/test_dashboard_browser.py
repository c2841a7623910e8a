"""The dashboard in a real browser: `stepscope dashboard` as a process, Debian's chromium driven by
Playwright, every page from the sidebar nav loaded headless; a screenshot per page, and a failure on any
exception box or error text. `make test` installs chromium (apt-get, as root); without it the test skips."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator

import pytest

from stepscope.procs import Proc
from tests.support.net import free_port

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on PATH: `make test` installs it with apt-get when run as root "
    "(or: apt-get install chromium)",
)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip
CHART = '[data-testid="stVegaLiteChart"], [data-testid="stArrowVegaLiteChart"], canvas, svg.marks'


@pytest.fixture(scope="module")
def dashboard(api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`stepscope dashboard --api` on a free port; its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    proc = Proc(["dashboard", "--api", api, "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/_stcore/health", 120)
        yield url
    finally:
        proc.stop()


def test_every_page_renders_in_chromium_without_errors(
    dashboard: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from playwright.sync_api import sync_playwright

    shots = tmp_path_factory.mktemp("screenshots")
    problems, seen = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(dashboard + "/")
        page.wait_for_selector('[data-testid="stSidebarNav"] a', timeout=120_000)
        links = list(
            dict.fromkeys(
                a.get_attribute("href") for a in page.query_selector_all('[data-testid="stSidebarNav"] a')
            )
        )
        for i, link in enumerate(links):
            page.goto(link)
            page.wait_for_selector('[data-testid="stAppViewContainer"]', timeout=60_000)
            page.wait_for_selector("h1", timeout=60_000)
            page.wait_for_timeout(4000)  # charts render after the script's last message
            name = re.sub(r"[^A-Za-z0-9]+", "_", link.rstrip("/").rsplit("/", 1)[-1]) or "overview"
            if link.rstrip("/") == dashboard:
                name = "overview"
            page.screenshot(path=str(shots / f"{i:02d}_{name}.png"), full_page=True)
            seen.append(name)
            text = page.inner_text("body")
            if page.query_selector_all('[data-testid="stException"]') or re.search(
                r"Traceback|Exception:", text
            ):
                problems.append(f"{name}: exception on the page")
            if not page.query_selector_all(CHART):
                problems.append(f"{name}: no chart")
        browser.close()
    print(f"screenshots: {shots}")
    assert len(seen) >= 6, seen
    assert not problems, problems
