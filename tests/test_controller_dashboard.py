"""The dashboard in a real headless browser (Debian's chromium through chromium-driver and selenium).

A live controller with three registered instances (two up, one down) and
the history of their heartbeats; the test reads the page as a person would:
the instances with their state, model, pipeline and tier fill, a hit-rate
line per instance, latency percentiles, recent events, and a prompt pasted
into the lookup box naming the instance that holds it. The page asks for a
reader token once and keeps it for the tab (a reload does not ask again). The
page redraws every two seconds, so every read of an element retries when the
element was replaced under it. The last screenshot is
written to ``docs/dashboard.png`` when ``FLOWKV_WRITE_SCREENSHOT`` is set.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from fleet_helpers import ControllerProcess, chunk_keys, wait_for
from flowkv.fleet.protocol import Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session
from flowkv.fleet.tokens import Tokenizers
from vllm_helpers import tiny_model_dir

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
DOCUMENT = ("The Amazon rainforest covers much of the Amazon basin of South America. " * 12).strip()

pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
                                reason="needs Debian's chromium and chromium-driver (make setup installs them)")


class Counters:
    """What an instance's engine counters say at each heartbeat: lookups that hit more and more."""

    def __init__(self, hit_share: float, capacity: int) -> None:
        self.beats = 0
        self.hit_share = hit_share
        self.capacity = capacity

    def __call__(self) -> dict:
        self.beats += 1
        asked = 1000 * self.beats
        share = min(1.0, self.hit_share * (1 + self.beats / 10))
        return {"counters": {"lookup_requested_tokens": asked, "lookup_hit_tokens": int(asked * share)},
                "tiers": {"memory": {"used_bytes": int(self.capacity * min(0.9, 0.1 * self.beats)),
                                     "capacity_bytes": self.capacity}},
                # Each instance's tenant "acme": 3 hits and 1 miss, 2 entries of 1 MiB (flowkv.tenants).
                "tenants": {"memory": {"acme": {"bytes": 2 << 20, "entries": 2, "hits": 3, "misses": 1,
                                                "evictions": 0}}}}


def instance(url: str, instance_id: str, *, pipeline: str, stats: Counters, token_file: Path) -> Reporter:
    registration = Registration(
        instance_id=instance_id, session=new_session(), model="tiny", tokenizer=str(tiny_model_dir()),
        url=f"http://127.0.0.1:{8000 + ord(instance_id[-1]) - ord('a')}", pipeline=pipeline, chunk_size=16, hash="sha256_cbor",
        tiers=[TierInfo(name="memory", kind="memory", capacity_bytes=stats.capacity),
               TierInfo(name="disk", kind="disk", capacity_bytes=8 << 30)])
    reporter = Reporter(ReporterConfig(url=url, heartbeat_s=0.3, token_file=str(token_file)), registration,
                        stats=stats).start()
    reporter.observe_latencies({"store": [2.0, 2.5, 3.1, 9.0], "retrieve": [0.8, 1.1, 1.2, 4.0]})
    return reporter


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"flowkv-chromium-{os.getpid()}"
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def fresh(read, what: str, timeout_s: float = 60):
    """``read()`` once it is truthy, retried while the page replaces the elements it reads."""
    from selenium.common.exceptions import StaleElementReferenceException

    def attempt():
        try:
            return read()
        except StaleElementReferenceException:
            return None

    return wait_for(attempt, what, timeout_s=timeout_s)


def test_the_dashboard_shows_instances_hit_rate_latency_events_and_answers_a_pasted_prompt(tmp_path, browser):
    from selenium.webdriver.common.by import By

    controller = ControllerProcess(tmp_path / "controller", timeout_s=2.0).start()
    token_file = controller.token_file
    reporters = []
    try:
        tokens = Tokenizers().encode(str(tiny_model_dir()), prompt=DOCUMENT)
        holder = instance(controller.url, "vllm-a", pipeline="cpu-disk", stats=Counters(0.3, 4 << 30),
                          token_file=token_file)
        other = instance(controller.url, "vllm-b", pipeline="local-cpu", stats=Counters(0.1, 2 << 30),
                         token_file=token_file)
        gone = instance(controller.url, "vllm-c", pipeline="local-cpu", stats=Counters(0.0, 2 << 30),
                        token_file=token_file)
        reporters += [holder, other, gone]
        assert all(r.wait_idle(60) for r in reporters)
        keys = chunk_keys(tokens, chunk_size=16, hash_name="sha256_cbor", model="tiny")
        for key in keys[:-2]:
            holder.offer("admit", "memory", key)
        holder.offer("admit", "disk", keys[-2])
        other.offer("admit", "memory", keys[0])
        gone.close()
        assert holder.wait_idle(60) and other.wait_idle(60)
        wait_for(lambda: controller.instance("vllm-c")["state"] == "down", "vllm-c is marked down")
        # Some heartbeats, so the hit-rate chart has points.
        wait_for(lambda: len(controller.get("/api/history").get("vllm-a", [])) >= 4, "heartbeats carry stats")

        browser.get(controller.url + "/")
        # No token yet: the page asks for one (a wrong one is refused and asked for again).
        for token in ("not-a-token", controller.tokens["reader"]):
            fresh(lambda: browser.find_element(By.ID, "token-form").is_displayed(), "the page asks for a token")
            browser.find_element(By.ID, "token-input").send_keys(token)
            browser.find_element(By.ID, "token-button").click()
        fresh(lambda: browser.find_elements(By.CSS_SELECTOR, "#instances tbody tr[data-instance]"),
              "the instances table is filled")
        assert browser.execute_script("return sessionStorage.getItem('flowkv-controller-token')") == \
            controller.tokens["reader"]
        assert browser.execute_script("return localStorage.length") == 0
        browser.refresh()  # the same tab: the token is kept, nothing is asked again

        def table():
            rows = browser.find_elements(By.CSS_SELECTOR, "#instances tbody tr[data-instance]")
            return {row.get_attribute("data-instance"): row.text for row in rows}

        table = fresh(lambda: (lambda t: t if len(t) == 3 else None)(table()), "the instances table is filled")
        assert not browser.find_element(By.ID, "token-form").is_displayed()
        assert set(table) == {"vllm-a", "vllm-b", "vllm-c"}
        assert "up" in table["vllm-a"] and "cpu-disk" in table["vllm-a"] and "tiny" in table["vllm-a"]
        assert "down" in table["vllm-c"]
        assert fresh(lambda: browser.find_element(By.ID, "summary").text == "3 instances · 2 up · 1 down",
                     "the summary counts the instances")

        # Tier fill: one bar per tier, memory filling as heartbeats report it.
        def bars():
            found = browser.find_elements(By.CSS_SELECTOR, 'tr[data-instance="vllm-a"] .tier')
            return [(bar.get_attribute("data-tier"), bar.text, bar.find_element(By.TAG_NAME, "em").text)
                    for bar in found]

        tiers = fresh(bars, "vllm-a's tiers are drawn")
        assert [name for name, _, _ in tiers] == ["memory", "disk"]
        assert f"{len(keys) - 2} chunks" in tiers[0][1] and "1 chunks" in tiers[1][1]
        assert int(tiers[0][2].rstrip("%")) > 0
        # Hit rate over time: a line per instance that reports lookups.
        fresh(lambda: browser.find_elements(By.CSS_SELECTOR, "#hitrate polyline"), "the hit-rate chart is drawn")
        assert "vllm-a" in fresh(lambda: browser.find_element(By.ID, "hitrate-legend").text, "the legend")
        latency = fresh(lambda: browser.find_element(By.ID, "latency").text, "the latency table")
        assert "store" in latency and "retrieve" in latency and "9.00" in latency
        # Tenants, summed over the fleet: vllm-a and vllm-b up (vllm-c's last report counts too).
        tenant = fresh(lambda: [row.text.split() for row in
                                browser.find_elements(By.CSS_SELECTOR, '#tenants tr[data-tenant="acme"]')],
                       "the tenants table is filled")[0]
        assert tenant == ["acme", "6.0", "MiB", "6", "75%", "9", "3", "0"]
        events = fresh(lambda: browser.find_element(By.ID, "events").text, "the events list")
        assert "admit" in events and "vllm-a" in events and "down" in events

        # Paste the document into the lookup box: vllm-a holds its longest prefix, vllm-b one chunk.
        box = browser.find_element(By.ID, "lookup-text")
        box.send_keys(DOCUMENT)
        browser.find_element(By.ID, "lookup-button").click()

        def answers():
            rows = browser.find_elements(By.CSS_SELECTOR, "#lookup-result tr[data-instance]")
            return [(row.get_attribute("data-instance"), [cell.text for cell in row.find_elements(By.TAG_NAME, "td")])
                    for row in rows]

        found = fresh(answers, "the lookup answers")
        assert [name for name, _ in found] == ["vllm-a", "vllm-b"]
        cells = found[0][1]
        assert int(cells[2]) == 16 * (len(keys) - 1)
        assert cells[3] == f"memory: {len(keys) - 2}, disk: 1"
        status = fresh(lambda: browser.find_element(By.ID, "lookup-status").text, "the lookup's status line")
        assert status.startswith(f"{len(tokens)} tokens · 2 holders")
        time.sleep(2.5)  # one more refresh, so the screenshot shows a settled page
        if os.environ.get("FLOWKV_WRITE_SCREENSHOT"):
            browser.set_window_size(1400, 1150)
            browser.save_screenshot(str(Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"))
    finally:
        for reporter in reporters:
            reporter.close()
        controller.close()
