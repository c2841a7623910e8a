"""The state machine on synthetic series: fires once after `for`, resolves after recovery, does not flap."""

from __future__ import annotations

import random

from alerting.evaluator import AlertState, Observation, step
from alerting.rules import parse_rules


def rule(extra: str = "", **fields: str):
    body = {"name": '"r"', "metric": '"ttft"', "threshold": '"2s"', "window": '"5s"', "for": '"3s"'} | fields
    text = "[[rule]]\n" + "".join(f"{k} = {v}\n" for k, v in body.items()) + extra
    return parse_rules(text).rules[0]


def run(r, values, requests=100):
    """Evaluate one value per second; return the transitions as (second, old, new)."""
    state, out = AlertState(r.name), []
    for t, v in enumerate(values):
        state, tr = step(r, state, Observation(v, requests if v is not None else 0), float(t))
        if tr:
            out.append((t, tr.old, tr.new))
    return out


def test_a_breach_fires_once_after_for_and_resolves_after_recovering_for_for():
    values = [0.2] * 5 + [3.0] * 10 + [0.2] * 10
    assert run(rule(), values) == [
        (5, "inactive", "pending"),
        (8, "pending", "firing"),  # breached at 5, 6, 7, 8: held for 3 s
        (18, "firing", "resolved"),  # clear at 15 .. 18
    ]


def test_a_breach_shorter_than_for_never_fires():
    assert run(rule(), [0.2, 3.0, 3.0, 0.2, 3.0, 3.0, 3.0, 0.2]) == [
        (1, "inactive", "pending"),
        (3, "pending", "inactive"),
        (4, "inactive", "pending"),
        (7, "pending", "inactive"),
    ]


def test_noise_around_the_threshold_never_alternates_firing_and_resolved():
    rng = random.Random(7)
    noise = [2.0 + rng.uniform(-0.15, 0.15) for _ in range(300)]
    events = [new for _, _, new in run(rule(), [3.0] * 5 + noise)]
    assert events.count("firing") == 1 and "resolved" not in events
    events = [new for _, _, new in run(rule(), noise)]
    assert events.count("firing") <= 1 and "resolved" not in events


def test_without_hysteresis_and_for_the_same_noise_would_flap():
    """The control for the test above: the anti-flap rule is what keeps the noise quiet."""
    rng = random.Random(7)
    noise = [2.0 + rng.uniform(-0.15, 0.15) for _ in range(300)]
    events = [new for _, _, new in run(rule(**{"for": '"0s"', "hysteresis": "0"}), noise)]
    assert events.count("firing") > 20


def test_a_dip_into_the_band_during_recovery_restarts_the_recovery_clock():
    values = [3.0] * 5 + [0.2, 0.2, 1.9, 0.2, 0.2, 0.2, 0.2]
    assert run(rule(), values)[-1] == (11, "firing", "resolved")  # clear again from 8, held to 11


def test_too_few_requests_is_no_data_and_no_traffic_is_clear():
    r = rule("min_requests = 20\n")
    assert run(r, [3.0] * 10, requests=5) == []
    fired = run(r, [3.0] * 5 + [None] * 5)
    assert [new for _, _, new in fired] == ["pending", "firing", "resolved"]


def test_throughput_alerts_when_it_falls_below_and_clears_above_the_margin():
    r = rule(metric='"throughput"', threshold="10", **{"for": '"1s"'})
    events = run(r, [12.0, 9.0, 9.0, 10.5, 10.5, 11.5, 11.5])
    assert [(t, new) for t, _, new in events] == [(1, "pending"), (2, "firing"), (6, "resolved")]


def test_a_burn_rate_value_above_one_breaches():
    r = parse_rules(
        '[[rule]]\nname = "s"\ntype = "burn_rate"\nmetric = "ttft"\nobjective = "99%"\nthreshold = "2s"\n'
    ).rules[0]
    assert [new for _, _, new in run(r, [0.5, 1.5, 0.95, 0.5])] == ["firing", "resolved"]
