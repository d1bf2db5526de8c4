"""What a person sees: pages of MLflow's and Prefect's UIs opened in headless Chromium.

The browser is Debian's `chromium` (the Makefile's `test` target installs it when missing),
driven by Playwright; Playwright's own browser downloads are never used. conftest.py holds the
session's browser and a fresh `ui` page per test; a failed test leaves a screenshot of its page
in SCREENSHOTS."""

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import (
    Browser,
    ConsoleMessage,
    HttpCredentials,
    Locator,
    Page,
    Playwright,
    Response,
)

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-screenshots"
"""Where a failed browser test leaves a screenshot of its page (ignored by git)."""

TIMEOUT_MS = 60_000
"""How long a page may take to show what a test waits for: MLflow's UI bundle is a few MB of
JavaScript, parsed on a busy 2-core machine."""


def chromium_path() -> str:
    """The system Chromium's executable; an error saying how to install it if there is none."""
    path = shutil.which("chromium")
    if path is None:
        raise RuntimeError(
            "no `chromium` on PATH: the browser tests drive Debian's Chromium; install it with "
            "`make test` (or `apt-get install -y chromium`)"
        )
    return path


@contextmanager
def launch(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
    try:
        yield browser
    finally:
        browser.close()


@dataclass
class UiPage:
    """A page in a browser context of its own, with what went wrong while it loaded: HTTP
    answers of 500 and more (an UI often hides them) and errors on the JavaScript console."""

    page: Page
    server_errors: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)

    def _response(self, response: Response) -> None:
        if response.status >= 500:
            self.server_errors.append(f"{response.status} {response.request.method} {response.url}")

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    def open(self, url: str) -> Page:
        self.page.goto(url, wait_until="domcontentloaded")
        return self.page


@contextmanager
def open_page(browser: Browser) -> Iterator[UiPage]:
    """A fresh browser context and page. The context passes MLflow's HTTP basic credentials
    when MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD are set (MLflow's basic-auth
    app asks the browser for them)."""
    username = os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    credentials: HttpCredentials | None = None
    if username and password:
        credentials = {"username": username, "password": password}
    context = browser.new_context(
        http_credentials=credentials, viewport={"width": 1400, "height": 900}
    )
    context.set_default_timeout(TIMEOUT_MS)
    try:
        page = UiPage(context.new_page())
        page.page.on("response", page._response)
        page.page.on("console", page._console)
        yield page
    finally:
        context.close()


_VISIBLE_SPAN_JS = """(element) => {
    let left = 0, right = window.innerWidth;
    for (let e = element.parentElement; e; e = e.parentElement) {
        if (getComputedStyle(e).overflowX !== "visible") {
            const box = e.getBoundingClientRect();
            left = Math.max(left, box.left);
            right = Math.min(right, box.right);
        }
    }
    return [left, right];
}"""


def visible_span(element: Locator) -> tuple[float, float]:
    """The horizontal span of the page (left, right in px) where `element` can be seen: the
    window, cut to each enclosing box that clips or scrolls what overflows it (a modal's card,
    a pane)."""
    left, right = element.evaluate(_VISIBLE_SPAN_JS)
    return left, right


def screenshot(page: Page, name: str) -> Path:
    """Save the page as SCREENSHOTS/<name>.png (full page); its path."""
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{name.replace('/', '_').replace('::', '-')}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
