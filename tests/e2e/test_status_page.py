"""The status page (/ui) in a real headless Chromium against a real cluster with auth on: it asks
for the admin key, then shows the model, the instance with its tier and worker pid, the cold
start as a bar stacked by phase, and the TTFT of a request made while it is open.

Needs Debian's `chromium` and `chromium-driver` (`apt-get install -y chromium chromium-driver`,
about 120 MB to download) and selenium from the `test` extra; skipped when the browser or its
driver is missing. Selenium Manager is never used: it downloads drivers, and nothing can be
downloaded here. The screenshot goes to docs/status_page.png when
TESSERA_WRITE_SCREENSHOT=1 (so that a test run leaves the tree clean), else to the test's `tmp_path`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.localcluster import DEFAULT_MODEL_NAME, LocalCluster
from tests.helpers.cluster import wait_for

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless Chromium is not installed (apt-get install -y chromium chromium-driver)",
)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
By = pytest.importorskip("selenium.webdriver.common.by").By
StaleElementReferenceException = pytest.importorskip("selenium.common.exceptions").StaleElementReferenceException

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "status_page.png"
PHASE_NAMES = {"init", "load", "profile", "prefill", "other"}
PAGE_TIMEOUT_S = 30.0
"""The page polls every 2 s; a few polls at most, with room for a loaded 2-core machine."""


@pytest.fixture
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # --no-sandbox: the tests may run as root in a container, where Chromium's sandbox cannot start.
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def chat(cluster: LocalCluster) -> None:
    r = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        headers=cluster.admin_headers,
        timeout=300,
        json={"model": DEFAULT_MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 200, r.text


def admin_get(cluster: LocalCluster, path: str) -> Any:
    r = httpx.get(f"{cluster.base_url}{path}", headers=cluster.admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_status_page_asks_for_the_key_then_shows_models_instances_cold_starts_and_ttft(
    auth_cluster: LocalCluster, browser: Any, tmp_path: Path
) -> None:
    cluster, driver = auth_cluster, browser
    chat(cluster)  # nothing runs yet: this request cold-starts the model
    # The engine publishes the record once the first token is out; it is stored a moment later.
    start = wait_for(
        lambda: next((s for s in admin_get(cluster, "/admin/coldstarts") if s["model"] == DEFAULT_MODEL_NAME), None),
        30,
        "the cold-start record",
    )
    instance = wait_for(  # its worker_pid is 0 until a heartbeat after its start names it
        lambda: next(
            (
                i
                for n in admin_get(cluster, "/admin/instances")["nodes"]
                for i in n["instances"]
                if i["model"] == DEFAULT_MODEL_NAME and i["worker_pid"]
            ),
            None,
        ),
        10,
        "the heartbeat to name the instance's worker",
    )

    page = httpx.get(f"{cluster.base_url}/ui", timeout=10)
    assert page.status_code == 200, "no /ui: create_app must include services.gateway.ui.ui_router"
    # The page is open; its data is not.
    assert httpx.get(f"{cluster.base_url}/ui/api/summary", timeout=10).status_code == 401

    def visible(css: str, read: Callable[[Any], Any] = lambda e: e) -> Any:
        """`read` of the first element matching `css` once it is shown, else None. The page
        re-renders as its data refreshes, so an element found may be gone by the time it is
        read: then None too, and the caller's wait looks again."""
        try:
            found = driver.find_elements(By.CSS_SELECTOR, css)
            return read(found[0]) if found and found[0].is_displayed() else None
        except StaleElementReferenceException:
            return None

    driver.get(f"{cluster.base_url}/ui")
    key_input = wait_for(lambda: visible("#key-input"), PAGE_TIMEOUT_S, "the page to ask for the admin key")
    assert driver.find_element(By.ID, "state").get_attribute("data-state") == "key"
    key_input.send_keys(cluster.admin_key)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()

    row_text = wait_for(
        lambda: visible(f'#models tr[data-model="{DEFAULT_MODEL_NAME}"]', lambda e: e.text),
        PAGE_TIMEOUT_S,
        "the model in the models table",
    )
    assert driver.find_element(By.ID, "state").get_attribute("data-state") == "ok"
    assert "running on node-0" in row_text

    pid, tier = wait_for(
        lambda: visible(
            f'#nodes tr[data-instance="{DEFAULT_MODEL_NAME}"]',
            lambda e: (e.find_element(By.CSS_SELECTOR, ".pid").text, e.find_element(By.CSS_SELECTOR, ".tier").text),
        ),
        PAGE_TIMEOUT_S,
        "the instance in its node's table",
    )
    assert pid == str(instance["worker_pid"])
    # The worker may tier up meanwhile; it stays the same process.
    assert tier in ("start", "steady")
    # The node's host cache and what it holds (the first start fills it behind itself).
    cache_text = wait_for(
        lambda: visible('#nodes [data-cache-node="node-0"]', lambda e: e.text if "(start," in e.text else None),
        PAGE_TIMEOUT_S,
        "the host cache contents on the page",
    )
    assert "host cache" in cache_text

    source, phases = wait_for(
        lambda: visible(
            f'#coldstart-chart g.bar[data-model="{DEFAULT_MODEL_NAME}"]',
            lambda e: (
                e.get_attribute("data-source"),
                [
                    (r.get_attribute("data-phase"), r.get_attribute("data-seconds"), r.get_attribute("height"))
                    for r in e.find_elements(By.CSS_SELECTOR, "rect")
                ],
            ),
        ),
        PAGE_TIMEOUT_S,
        "a cold-start bar",
    )
    assert source == start["source"]
    shown = {phase: float(seconds) for phase, seconds, _ in phases}
    assert {"load", "prefill"} <= set(shown) <= PHASE_NAMES, shown
    assert shown["load"] == pytest.approx(start["phases"]["load_s"])
    # The stack is the whole start: the four phases and what the record's total holds beyond them.
    assert sum(shown.values()) == pytest.approx(start["total_s"], rel=1e-6)
    heights = [float(h) for _, _, h in phases]
    assert all(h > 0 for h in heights)

    # Live: a request made while the page is open shows up as a TTFT point.
    chat(cluster)
    wait_for(
        lambda: int(visible("#ttft-chart", lambda e: e.get_attribute("data-points")) or 0) >= 1,
        PAGE_TIMEOUT_S,
        "a TTFT point for the request made while the page is open",
    )
    assert driver.find_elements(By.CSS_SELECTOR, '#ttft-chart circle[data-quantile="p99"]')

    # The whole page in one image: a viewport as tall as the document.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1400, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
    )
    shot = SCREENSHOT if os.environ.get("TESSERA_WRITE_SCREENSHOT") == "1" else tmp_path / SCREENSHOT.name
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(shot))
