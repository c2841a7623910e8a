"""`stepscope alerts`: check a rules file, list rules and their state, show past alerts, run the evaluator.

    stepscope alerts test rules.toml                       # exit 0, or exit 2 naming the rule and field
    stepscope alerts test rules.toml --api URL             # ... and evaluate each rule once, no notification
    stepscope alerts list rules.toml --api URL             # rules with their last recorded state
    stepscope alerts history --api URL [--rule R] [--since 1d] [--json]
    stepscope alerts run --rules rules.toml --api URL [--history alerts.jsonl] [--once]

`--api` reads a running collector (its `/api/sql`); `--store DSN` opens a store no collector holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from alerting.evaluator import AlertState, judge
from alerting.rules import RuleError, RuleSet, fmt_value, load_rules


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `alerts` subcommands."""
    sub = parser.add_subparsers(dest="alerts_command", metavar="ACTION", required=True)

    def source_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--api", metavar="URL", help="a running collector, e.g. http://127.0.0.1:4318")
        p.add_argument("--store", metavar="DSN", help="a store no collector holds (chdb:///dir, http://...)")
        p.add_argument("--token", default=os.environ.get("STEPSCOPE_TOKEN"), help="the collector's token")

    p = sub.add_parser("test", help="check a rules file (and, with a source, evaluate it once)")
    p.add_argument("rules", metavar="RULES")
    source_args(p)
    p = sub.add_parser("list", help="show the rules and their last recorded state")
    p.add_argument("rules", metavar="RULES")
    source_args(p)
    p = sub.add_parser("history", help="past alert transitions, newest first")
    source_args(p)
    p.add_argument("--rule", help="only this rule")
    p.add_argument("--since", default="7d", help="how far back: 90m, 1d, ISO 8601 or unix seconds (7d)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p = sub.add_parser("run", help="evaluate the rules every interval and notify (outside a collector)")
    p.add_argument("--rules", required=True, metavar="RULES")
    source_args(p)
    p.add_argument("--history", metavar="FILE", help="append transitions here as JSON lines (with --api)")
    p.add_argument("--once", action="store_true", help="one evaluation round, then exit")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action."""
    return {"test": _test, "list": _list, "history": _history, "run": _run}[args.alerts_command](args)


def _usage(message: str) -> Exception:
    from stepscope.cli import UsageError

    return UsageError(message)


def _rules(path: str) -> RuleSet:
    try:
        return load_rules(path)
    except RuleError as e:
        raise _usage(str(e)) from None


class _Source:
    """The reader for --api or --store, with `query(sql, params)`; `store` set for --store."""

    def __init__(self, args: argparse.Namespace, *, required: bool) -> None:
        from collector.client import ApiReader
        from collector.store import Store, StoreError

        self.store: Any = None
        self.reader: Any = None
        if args.api and args.store:
            raise _usage("give --api or --store, not both")
        if args.api:
            self.reader = ApiReader(args.api, args.token)
        elif args.store:
            try:
                self.store = Store.open(args.store)  # migrates: the alerts table exists afterwards
            except (StoreError, ValueError) as e:
                raise _usage(str(e)) from None
        elif required:
            raise _usage("give --api URL (a running collector) or --store DSN")

    @property
    def present(self) -> bool:
        return self.reader is not None or self.store is not None

    def query(self, sql: str, parameters: dict[str, Any] | None = None, /) -> Any:
        if self.store is not None:
            return self.store.query_readonly(sql, parameters=parameters, max_rows=100_000, timeout_s=120)
        return self.reader.query(sql, parameters)

    def close(self) -> None:
        for part in (self.reader, self.store):
            if part is not None:
                part.close()


def _test(args: argparse.Namespace) -> int:
    from alerting.queries import observe

    ruleset = _rules(args.rules)
    notify = ruleset.notify
    print(f"{args.rules}: {len(ruleset.rules)} rule(s), every {notify.interval_s:g}s -> "
          f"{notify.webhook or 'log only (no webhook)'}")  # fmt: skip
    source = _Source(args, required=False)
    try:
        now = time.time()
        for rule in ruleset.rules:
            line = f"  {rule.describe()}"
            if source.present:
                obs = observe(rule, source, now)
                value = "no data" if obs.value is None else _show(rule, obs.value)
                line += f"  => {value} over {obs.requests} requests: {judge(rule, obs)}"
            print(line)
    except Exception as e:
        raise _usage(f"cannot evaluate: {e}") from None
    finally:
        source.close()
    return 0


def _show(rule: Any, value: float) -> str:
    return f"{value:.3g}x burn limit" if rule.kind == "burn_rate" else fmt_value(rule, value)


def _list(args: argparse.Namespace) -> int:
    from alerting.runner import LATEST_STATES_SQL

    ruleset = _rules(args.rules)
    source = _Source(args, required=False)
    states: dict[str, tuple[str, Any, Any]] = {}
    try:
        if source.present:
            states = {r[0]: (r[1], r[2], r[3]) for r in source.query(LATEST_STATES_SQL).rows}
    except Exception as e:
        raise _usage(f"cannot read alert states: {e}") from None
    finally:
        source.close()
    for rule in ruleset.rules:
        state, active_at, at = states.get(rule.name, (AlertState(rule.name).state, None, None))
        when = f" since {_t(active_at)}" if state in ("pending", "firing") and active_at else ""
        last = f" (last change {_t(at)})" if at else ("" if source.present else " (state unknown: no source)")
        print(f"{state.upper():9} {rule.describe()}{when}{last}")
    return 0


def _history(args: argparse.Namespace) -> int:
    from collector.timerange import parse_time

    try:
        since = parse_time(args.since)
    except ValueError as e:
        raise _usage(str(e)) from None
    if args.limit < 1:
        raise _usage("--limit must be positive")
    sql = (
        "SELECT time, rule, previous, state, severity, metric, value, threshold, requests, summary, details "
        "FROM alerts WHERE time >= fromUnixTimestamp64Milli(toInt64({since:Float64} * 1000)) "
        "AND ({rule:String} = '' OR rule = {rule:String}) ORDER BY time DESC LIMIT {limit:UInt32}"
    )
    source = _Source(args, required=True)
    try:
        result = source.query(sql, {"since": since, "rule": args.rule or "", "limit": args.limit})
    except Exception as e:
        raise _usage(f"cannot read alert history: {e}") from None
    finally:
        source.close()
    for row in result.dicts():
        if args.json:
            row["details"] = json.loads(row["details"] or "{}")
            print(json.dumps(row, default=str))
        else:
            value = "-" if row["value"] is None else f"{row['value']:.4g}"
            print(f"{_t(row['time'])}  {row['rule']:20} {row['previous']:>8} -> {row['state']:8} "
                  f"value {value:>8}  {row['summary']}")  # fmt: skip
    if not result.rows and not args.json:
        print("no alert transitions in that time")
    return 0


def _run(args: argparse.Namespace) -> int:
    from alerting.runner import AlertRunner, JsonlHistory, StoreHistory

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    ruleset = _rules(args.rules)
    source = _Source(args, required=True)
    if source.store is not None:
        history: Any = StoreHistory(lambda: source.store)
    else:
        history = JsonlHistory(args.history) if args.history else None
    runner = AlertRunner(ruleset, source, history=history, description=args.api or args.store)
    if args.once:
        if runner.sender is not None:
            runner.sender.start()
        transitions = runner.evaluate()
        runner.stop()
        for t in transitions:
            print(f"{t.rule}: {t.old} -> {t.new}")
        source.close()
        return 0
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    runner.start()
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop()
        source.close()
    return 0


def _t(value: Any) -> str:
    text = value.isoformat() if hasattr(value, "isoformat") else str(value)
    return text.replace("+00:00", "").removesuffix("Z")[:23] + "Z"
