"""Rules files: the documented form, burn-rate SLO rules, filters, and errors that name rule and field."""

from __future__ import annotations

import pytest

from alerting.rules import BurnWindow, RuleError, parse_duration, parse_quantity, parse_rules
from stepscope.cli import main

ISSUE_FORM = """
[notify]
webhook = "http://127.0.0.1:9000/hook"
interval = "10s"

[[rule]]
name = "ttft-p99"
metric = "ttft"          # ttft | tpot | e2e | queue | throughput | goodput | error_rate
percentile = 99
threshold = "2s"
window = "1m"
for = "20s"
severity = "page"
"""


def test_the_issues_exact_form_parses_into_typed_values():
    rs = parse_rules(ISSUE_FORM)
    assert rs.notify.webhook == "http://127.0.0.1:9000/hook"
    assert rs.notify.interval_s == 10.0
    (rule,) = rs.rules
    assert (rule.name, rule.metric, rule.kind, rule.severity) == ("ttft-p99", "ttft", "threshold", "page")
    assert (rule.percentile, rule.threshold, rule.window_s, rule.for_s) == (99.0, 2.0, 60.0, 20.0)
    assert rule.above and rule.filters == ()


def test_burn_rate_rule_defaults_to_the_sre_workbook_page_windows():
    rs = parse_rules(
        '[[rule]]\nname = "slo"\ntype = "burn_rate"\nmetric = "ttft"\nobjective = "99%"\nthreshold = "2s"\n'
    )
    (rule,) = rs.rules
    assert rule.kind == "burn_rate" and rule.objective == pytest.approx(0.99)
    assert rule.burn == (BurnWindow(3600, 300, 14.4), BurnWindow(21600, 1800, 6.0))
    assert rs.notify.webhook is None  # log only


def test_burn_rate_rule_takes_its_own_windows_and_an_error_rate_slo_needs_no_threshold():
    rs = parse_rules("""
[[rule]]
name = "errors"
type = "burn_rate"
metric = "error_rate"
objective = 99.9
burn = [{long = "1h", short = "5m", factor = 14.4}, {long = "3d", short = "6h", factor = 1}]
severity = "ticket"
""")
    (rule,) = rs.rules
    assert rule.objective == pytest.approx(0.999)
    assert rule.burn[1] == BurnWindow(3 * 86400, 6 * 3600, 1.0)


def test_filters_by_service_model_and_role_become_rule_filters():
    rs = parse_rules(
        '[[rule]]\nname = "r"\nmetric = "tpot"\nthreshold = "80ms"\nservice = "engine"\nmodel = "llama"\n'
        'role = "decode"\n[[rule]]\nname = "gp"\nmetric = "goodput"\nthreshold = 2.5\nslo_ttft = "1s"\n'
    )
    tpot, goodput = rs.rules
    assert tpot.threshold == pytest.approx(0.08)
    assert dict(tpot.filters) == {"service": "engine", "model": "llama", "role": "decode"}
    assert not goodput.above and goodput.slo_ttft_s == 1.0


BASE = {"name": '"ttft-p99"', "metric": '"ttft"', "threshold": '"2s"', "window": '"1m"', "for": '"20s"'}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("threshold", '"2 parsecs"'),
        ("metric", '"latency"'),
        ("window", '"soon"'),
        ("percentile", "120"),
        ("for", '"-5s"'),
        ("servce", '"engine"'),
        ("hysteresis", "2"),
        ("objective", '"99%"'),
        ("severity", "3"),
    ],
)
def test_a_bad_field_is_named_with_its_rule(key, value):
    text = "[[rule]]\n" + "".join(f"{k} = {v}\n" for k, v in (BASE | {key: value}).items())
    with pytest.raises(RuleError) as e:
        parse_rules(text, "rules.toml")
    assert str(e.value).startswith("rules.toml: rule 'ttft-p99' field " + repr(key) + ":")


def test_duplicate_names_missing_threshold_and_bad_webhook_are_refused():
    with pytest.raises(RuleError, match="rule 'ttft-p99' field 'name': duplicate"):
        parse_rules(ISSUE_FORM + ISSUE_FORM.split("[notify]")[1].split("\n\n", 1)[1])
    with pytest.raises(RuleError, match="rule 'x' field 'threshold': missing"):
        parse_rules('[[rule]]\nname = "x"\nmetric = "e2e"\n')
    with pytest.raises(RuleError, match=r"\[notify\] field 'webhook'"):
        parse_rules('[notify]\nwebhook = "ftp://x"\n[[rule]]\nname = "x"\nmetric = "e2e"\nthreshold = 1\n')
    with pytest.raises(RuleError, match="not valid TOML"):
        parse_rules("[[rule]\n")


def test_durations_and_quantities():
    assert [parse_duration(x) for x in ("10s", "1m", "2h", "500ms", "1d", 3)] == [10, 60, 7200, 0.5, 86400, 3]
    assert [parse_quantity(x) for x in ("2s", "80ms", "1.5%", 3, "0.25")] == pytest.approx(
        [2, 0.08, 0.015, 3, 0.25]
    )


def test_cli_test_exits_0_on_a_good_file_and_2_with_one_line_naming_rule_and_field(tmp_path, capsys):
    good = tmp_path / "rules.toml"
    good.write_text(ISSUE_FORM)
    assert main(["alerts", "test", str(good)]) == 0
    assert "ttft-p99: p99 ttft > 2s over 1m for 20s [page]" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text(ISSUE_FORM.replace('window = "1m"', 'window = "a while"'))
    assert main(["alerts", "test", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rule 'ttft-p99' field 'window'" in err[0]
    assert main(["alerts", "test", str(tmp_path / "missing.toml")]) == 2
