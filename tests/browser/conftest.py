"""Headless Chromium for the HTML report tests (Debian's ``chromium`` package, driven by Playwright), and
speedscope (npm's ``speedscope`` package, unpacked, never run by node), which reads the folded export there.

Without Chromium (or speedscope) the tests are skipped, unless ``OOMDOCTOR_REQUIRE_BROWSER=1`` (set by
``.ci/run``, which installs both), where a missing one fails them.
"""

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("OOMDOCTOR_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# The flags of a closed network: without the background-networking ones Chromium dials Google's hosts.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
SPEEDSCOPE = Path(os.environ.get("OOMDOCTOR_SPEEDSCOPE") or
                  Path(__file__).resolve().parents[2] / "build" / "speedscope" / "package" / "dist" / "release" / "index.html")


def _missing(why: str) -> None:
    if os.environ.get("OOMDOCTOR_REQUIRE_BROWSER") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def browser():
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install -e '.[test]')"
    if missing is None and not os.path.exists(CHROMIUM):
        missing = f"Chromium not found at {CHROMIUM} (apt-get install chromium)"
    if missing:
        _missing(missing)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def speedscope() -> Path:
    """speedscope's page (``index.html`` of the npm package's ``dist/release``)."""
    if not SPEEDSCOPE.exists():
        _missing(f"speedscope not found at {SPEEDSCOPE} (mkdir -p build/speedscope && cd build/speedscope && "
                 "npm pack speedscope@1.25.0 && tar xzf speedscope-1.25.0.tgz)")
    return SPEEDSCOPE
