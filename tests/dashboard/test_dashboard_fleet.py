"""The sidebar's Services and Instances filters, run by Streamlit's AppTest against a collector serving two
simulated replicas: r0 (service engine-a) healthy throughout, r1 (service engine-b) with 120 ms scheduler
stalls in its second minute. Choosing one changes what every page shows, and the choice follows the user
from page to page."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from streamlit.testing.v1 import AppTest

from collector.store import Store
from dashboard.ui import fmt_s
from tests.dashboard.test_dashboard_pages import PAGES, open_app, show, texts
from tests.diagnosis.diag_simulate import SimConfig, write
from tests.support.collector import Collector, start_collector

REPLICAS = {"r0": ("engine-a", {}), "r1": ("engine-b", {"stall_ms": 120.0})}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """A collector over a store holding both replicas' spans (2 min at 3 req/s each, the fault at 1 min)."""
    root = tmp_path_factory.mktemp("fleet")
    store = Store.open(f"chdb://{root / 'data'}")
    try:
        for seed, (instance, (service, fault)) in enumerate(REPLICAS.items(), 1):
            cfg = SimConfig(
                seed=seed, duration_s=120.0, fault_at_s=60.0, rate_rps=3.0, service=service,
                instance=instance, fault=fault,
            )  # fmt: skip
            write(store, cfg)
    finally:
        store.close()  # chDB: one process per directory, and the collector's is next
    c = start_collector(f"chdb://{root / 'data'}", root / "collector.log", "--log-level", "warning")
    yield c
    c.stop()


def _p99_ttft(fleet: Collector, where: str = "1") -> str:
    return fmt_s(float(fleet.scalar(f"SELECT quantileExact(0.99)(ttft_s) FROM requests WHERE {where}")))


def _steps_caption(at: AppTest) -> int:
    (caption,) = [str(c.value) for c in at.caption if "steps in the range" in str(c.value)]
    return int(re.match(r"([\d,]+) steps", caption).group(1).replace(",", ""))


def test_choosing_an_instance_narrows_the_overview_to_its_requests(
    monkeypatch: pytest.MonkeyPatch, fleet: Collector
) -> None:
    at = show(open_app(monkeypatch, fleet.url), "overview")
    assert at.multiselect(key="scope_instances").options == ["r0", "r1"]
    assert at.metric[0].value == _p99_ttft(fleet), "unfiltered: both replicas"
    assert "Filtered to" not in texts(at, "info")
    at.multiselect(key="scope_instances").set_value(["r0"]).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.metric[0].value == _p99_ttft(fleet, "instance = 'r0'") != _p99_ttft(fleet)
    assert "Filtered to instance r0 (sidebar)." in texts(at, "info")


def test_the_choice_follows_the_user_to_every_page_and_filters_steps_too(
    monkeypatch: pytest.MonkeyPatch, fleet: Collector
) -> None:
    at = show(open_app(monkeypatch, fleet.url), "engine")
    assert _steps_caption(at) == int(fleet.scalar("SELECT count() FROM steps"))
    at.multiselect(key="scope_instances").set_value(["r1"]).run()
    assert _steps_caption(at) == int(fleet.scalar("SELECT count() FROM steps WHERE instance = 'r1'"))
    show(at, "instances")
    assert at.multiselect(key="scope_instances").value == ["r1"]
    assert list(at.dataframe[0].value["instance"]) == ["r1"]
    show(at, "requests")
    assert set(at.dataframe[0].value["instance"]) == {"r1"}


def test_choosing_a_service_narrows_the_instances_to_offer(
    monkeypatch: pytest.MonkeyPatch, fleet: Collector
) -> None:
    at = show(open_app(monkeypatch, fleet.url), "instances")
    assert list(at.dataframe[0].value["instance"]) == ["r0", "r1"]
    assert at.multiselect(key="scope_services").options == ["engine-a", "engine-b"]
    at.multiselect(key="scope_services").set_value(["engine-a"]).run()
    assert at.multiselect(key="scope_instances").options == ["r0"]
    assert list(at.dataframe[0].value["instance"]) == ["r0"]
    assert "Filtered to service engine-a (sidebar)." in texts(at, "info")


def test_findings_diagnose_only_the_chosen_instances(
    monkeypatch: pytest.MonkeyPatch, fleet: Collector
) -> None:
    at = open_app(monkeypatch, fleet.url)
    at.multiselect(key="scope_instances").set_value(["r0"]).run()
    show(at, "findings")
    assert "Diagnosis unavailable" not in texts(at, "info")
    assert "No significant regression" in texts(at, "success"), "r0 ran healthy throughout"
    at.multiselect(key="scope_instances").set_value(["r1"]).run()
    causes = [str(h.value) for h in at.subheader if str(h.value)[:1].isdigit()]
    assert causes and causes[0].startswith("1. scheduler_stall"), causes


@pytest.mark.parametrize("page", list(PAGES))
def test_every_page_renders_filtered_with_no_warning(
    monkeypatch: pytest.MonkeyPatch, fleet: Collector, page: str
) -> None:
    at = open_app(monkeypatch, fleet.url)
    at.multiselect(key="scope_services").set_value(["engine-b"]).run()
    show(at, page)
    assert not at.warning, texts(at, "warning")
    assert "Filtered to service engine-b (sidebar)." in texts(at, "info")
