"""The SQL over a real chDB store, the Alertmanager payload, and delivery to real HTTP receivers on loopback,
including a dead one that is retried with backoff while evaluation goes on."""

from __future__ import annotations

import datetime as dt

import pytest
from webhook_receiver import Receiver

from alerting.evaluator import Transition
from alerting.notify import ZERO_TIME, WebhookSender, alertmanager_payload
from alerting.queries import breakdown, breakdown_text, observe
from alerting.rules import parse_rules
from alerting.runner import LATEST_STATES_SQL, AlertRunner, StoreHistory
from collector.store import Store
from tests.support.net import free_port, wait_for

T0 = 1_700_000_000.0


class ReadOnly:
    """The store's read path, as the collector gives it to the runner."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def query(self, sql, parameters=None, /):
        return self.store.query_readonly(sql, parameters=parameters, max_rows=10_000, timeout_s=30)


@pytest.fixture
def store(tmp_path):
    with Store.open(f"chdb://{tmp_path / 'db'}") as s:
        yield s


def insert(store: Store, start: float, seconds: int, per_s: int, ttft: float, **extra) -> None:
    """`per_s` requests ending in each second of [start, start + seconds), queue = 80% of TTFT."""
    ends = [start + i + (j + 0.5) / per_s for i in range(seconds) for j in range(per_s)]
    rows = {
        "time": [dt.datetime.fromtimestamp(e - ttft - 1, dt.UTC).replace(tzinfo=None) for e in ends],
        "end_time": [dt.datetime.fromtimestamp(e, dt.UTC).replace(tzinfo=None) for e in ends],
        "service": [extra.get("service", "engine")] * len(ends),
        "instance": [extra.get("instance", "engine-0")] * len(ends),
        "model": ["m"] * len(ends),
        "ttft_s": [ttft] * len(ends),
        "queue_s": [ttft * 0.8] * len(ends),
        "prefill_s": [ttft * 0.2] * len(ends),
        "e2e_s": [ttft + 1] * len(ends),
        "input_tokens": [300] * len(ends),
        "is_error": [extra.get("is_error", 0)] * len(ends),
    }
    store.insert("requests", list(rows), list(rows.values()))


RULES = """
[notify]
webhook = "http://127.0.0.1:{port}/hook"
interval = "1s"
max_attempts = 50

[[rule]]
name = "ttft-p99"
metric = "ttft"
threshold = "2s"
window = "10s"
for = "2s"
service = "engine"

[[rule]]
name = "ttft-slo"
type = "burn_rate"
metric = "ttft"
objective = "90%"
threshold = "2s"
burn = [{{long = "60s", short = "10s", factor = 2}}]
"""


def test_observations_percentile_filters_burn_rate_and_breakdown(store):
    insert(store, T0, 60, 10, 0.2)
    insert(store, T0 + 60, 20, 10, 3.0)
    insert(store, T0 + 60, 20, 10, 9.0, service="other")
    rs = parse_rules(RULES.format(port=1))
    p99, slo = rs.rules
    src = ReadOnly(store)
    healthy, breached = observe(p99, src, T0 + 60), observe(p99, src, T0 + 80)
    assert (healthy.value, healthy.requests) == (pytest.approx(0.2), 100)
    assert (breached.value, breached.requests) == (pytest.approx(3.0), 100)  # service filter: not 9 s
    obs = observe(slo, src, T0 + 80)
    detail = dict(obs.detail)
    # bad fraction / (1 - objective): last 10 s all bad -> 10x; last 60 s 400 of 800 bad -> 5x
    assert detail == {"burn_rate_10s": pytest.approx(10.0), "burn_rate_1m": pytest.approx(5.0)}
    assert obs.value == pytest.approx(min(10.0, 5.0) / 2)
    b = breakdown(p99, src, (T0 + 60, T0 + 80), (T0 + 40, T0 + 60))
    queue = next(p for p in b["parts"] if p["part"] == "queue")
    assert queue["share"] == pytest.approx(0.8) and queue["current_s"] == pytest.approx(2.4)
    assert "queue 2.4 s = 80% of it (was 160 ms, 80%)" in breakdown_text(b)


def test_payload_has_alertmanagers_webhook_shape():
    body = alertmanager_payload(
        "firing", {"alertname": "ttft-p99", "severity": "page"}, {"summary": "s", "findings": "f"}, T0, None
    )
    assert body["version"] == "4" and body["status"] == "firing"
    assert body["groupLabels"] == {"alertname": "ttft-p99"}
    (alert,) = body["alerts"]
    assert alert["labels"] == {"alertname": "ttft-p99", "severity": "page"}
    assert alert["annotations"] == {"summary": "s", "findings": "f"}
    assert alert["startsAt"] == "2023-11-14T22:13:20.000Z" and alert["endsAt"] == ZERO_TIME
    resolved = alertmanager_payload("resolved", alert["labels"], {}, T0, T0 + 60)
    assert resolved["alerts"][0]["endsAt"] == "2023-11-14T22:14:20.000Z"
    assert resolved["alerts"][0]["fingerprint"] == alert["fingerprint"]


def test_dead_receiver_is_retried_with_backoff_while_evaluation_goes_on(store):
    insert(store, T0, 30, 10, 0.2)
    insert(store, T0 + 30, 10, 10, 3.0)
    insert(store, T0 + 40, 30, 10, 0.2)
    port = free_port()
    rs = parse_rules(RULES.format(port=port))
    sender = WebhookSender(rs.notify.webhook, max_attempts=50, backoff_first_s=0.05, backoff_max_s=0.4)
    runner = AlertRunner(rs, ReadOnly(store), history=StoreHistory(lambda: store), sender=sender.start())
    transitions = []
    for second in range(25, 70):  # evaluation rounds, one per simulated second, while the receiver is down
        transitions += [(t.rule, t.new) for t in runner.evaluate(T0 + second)]
    assert ("ttft-p99", "firing") in transitions and ("ttft-p99", "resolved") in transitions
    assert runner.rounds == 45
    wait_for(lambda: sender.stats["failed_attempts"] >= 4)
    assert list(sender.backoffs)[:4] == [0.05, 0.1, 0.2, 0.4]  # exponential, capped
    assert sender.stats["sent"] == 0
    receiver = Receiver(port)  # the receiver comes back: what was queued arrives, in order
    try:
        wait_for(lambda: sender.pending() == 0)
        statuses = [(b["alerts"][0]["labels"]["alertname"], b["status"]) for b in receiver.got]
        assert statuses.index(("ttft-p99", "firing")) < statuses.index(("ttft-p99", "resolved"))
        mine = [b for b in receiver.got if b["alerts"][0]["labels"]["alertname"] == "ttft-p99"]
        firing = next(b for b in mine if b["status"] == "firing")
        ann = firing["alerts"][0]["annotations"]
        assert "queue 2.4 s = 80% of it" in ann["breakdown"] and "findings" in ann
        resolved = next(b for b in mine if b["status"] == "resolved")["alerts"][0]
        fired = firing["alerts"][0]
        assert resolved["status"] == "resolved" and resolved["labels"] == fired["labels"]
        assert resolved["fingerprint"] == fired["fingerprint"] and resolved["startsAt"] == fired["startsAt"]
        assert resolved["endsAt"] != ZERO_TIME and resolved["endsAt"] > fired["startsAt"]
    finally:
        runner.stop()
        receiver.close()
    rows = store.query(
        "SELECT rule, previous, state FROM alerts WHERE rule = 'ttft-p99' ORDER BY time, state"
    ).rows
    assert rows == [
        ["ttft-p99", "inactive", "pending"],
        ["ttft-p99", "pending", "firing"],
        ["ttft-p99", "firing", "resolved"],
    ]
    latest = {r[0]: r[1] for r in store.query(LATEST_STATES_SQL).rows}
    assert latest["ttft-p99"] == "resolved"


def test_a_restarted_runner_takes_up_a_firing_alert_without_firing_again(store):
    insert(store, T0, 40, 10, 3.0)
    rs = parse_rules(RULES.format(port=free_port()).replace("max_attempts = 50", "max_attempts = 1"))
    first = AlertRunner(rs, ReadOnly(store), history=StoreHistory(lambda: store))
    for second in range(10, 15):
        first.evaluate(T0 + second)
    first.stop()
    second = AlertRunner(rs, ReadOnly(store), history=StoreHistory(lambda: store))
    second.restore(ReadOnly(store).query(LATEST_STATES_SQL).rows)
    assert second.states["ttft-p99"].state == "firing"
    assert [t for t in second.evaluate(T0 + 15) if t.rule == "ttft-p99"] == []


def test_transition_notifies_only_on_firing_and_resolved():
    states = ("inactive", "pending", "firing", "resolved")
    kinds = {new: Transition("r", "x", new, 0.0, None, None).notifies for new in states}
    assert kinds == {"inactive": False, "pending": False, "firing": True, "resolved": True}


def test_a_metrics_rule_reads_the_scraped_latency_histogram(store):
    """`source = "metrics"`: the percentile comes from the engine's TTFT histogram, for an engine whose
    request spans are sampled away or never sent."""
    import pyarrow as pa

    now = T0 + 600
    bounds = ("0.1", "0.5", "1.0", "2.5", "+Inf")
    rows = []
    for t, counts in ((now - 50, (0, 0, 0, 0, 0)), (now - 10, (0, 10, 40, 100, 100))):
        rows += [(t, "ttft_s_bucket", float(n), [("le", le)]) for le, n in zip(bounds, counts, strict=True)]
    table = pa.table(
        {
            "time": pa.array([int(t * 1e9) for t, *_ in rows], pa.int64()).cast(pa.timestamp("ns")),
            "service": ["vllm"] * len(rows),
            "instance": ["vllm-0"] * len(rows),
            "metric": [r[1] for r in rows],
            "value": [r[2] for r in rows],
            "labels": pa.array([r[3] for r in rows], pa.map_(pa.string(), pa.string())),
            "source_metric": ["vllm:time_to_first_token_seconds_bucket"] * len(rows),
            "origin": ["scrape"] * len(rows),
        }
    )
    store.insert("engine_samples", table.column_names, table)
    rules = parse_rules(
        '[[rule]]\nname = "ttft"\nmetric = "ttft"\nsource = "metrics"\npercentile = 50\n'
        'threshold = "1s"\nwindow = "1m"\ninstance = "vllm-0"\n'
    )
    (rule,) = rules.rules
    assert "(from metrics)" in rule.describe()
    got = observe(rule, ReadOnly(store), now)
    assert got.requests == 100 and got.value == pytest.approx(1.0 + 1.5 * 10 / 60)
    with pytest.raises(ValueError, match="source"):
        parse_rules(
            '[[rule]]\nname = "x"\nmetric = "ttft"\nsource = "metrics"\nthreshold = "1s"\nmodel = "m"\n'
        )


def test_a_rule_grouped_by_instance_fires_once_for_the_slow_instance_labelled(store):
    insert(store, T0, 60, 2, 0.2, instance="r0")
    insert(store, T0, 60, 2, 3.0, instance="r1")
    text = """
[[rule]]
name = "ttft-p99"
metric = "ttft"
threshold = "1s"
window = "30s"
group_by = ["instance"]
"""
    runner = AlertRunner(parse_rules(text), ReadOnly(store))
    fired = runner.evaluate(T0 + 60)
    assert [(t.rule, t.new) for t in fired] == [("ttft-p99/r1", "firing")]
    rule = next(r for r in runner._expanded(T0 + 60) if r.name == "ttft-p99/r1")
    assert runner.labels(rule)["alertname"] == "ttft-p99" and runner.labels(rule)["instance"] == "r1"
