"""The evaluation loop: every `interval`, observe each rule, advance its state, record transitions, notify.

    runner = AlertRunner(ruleset, source, history=StoreHistory(lambda: store))
    runner.start()            # a daemon thread; runner.evaluate(now) runs one round by hand
    runner.stop()

One thread evaluates; a second ("alert-notify") builds the notification of each firing or resolved
transition (breakdown and diagnosis: SQL that may take seconds) and records it; the webhook sender posts
from a third. A slow store query delays only the round it is in; a slow receiver or diagnosis delays no
evaluation. Used inside the collector (`--alert-rules`, reading the collector's own store) and by
`stepscope alerts run --api URL` (reading a collector's `/api/sql`).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from alerting import enrich
from alerting.evaluator import FIRING, AlertState, Observation, Transition, step
from alerting.notify import WebhookSender, alertmanager_payload
from alerting.queries import QuerySource, groups, observe
from alerting.rules import Rule, RuleSet, fmt_value

log = logging.getLogger("alerting")

ALERT_COLUMNS = (
    "time", "rule", "state", "previous", "severity", "metric", "value", "threshold", "requests",
    "active_at", "labels", "summary", "details",
)  # fmt: skip


class History(Protocol):
    """Where transitions are recorded."""

    def record(self, rows: list[dict[str, Any]]) -> None: ...


class StoreHistory:
    """The `alerts` table of a store (the collector's own, inside the collector)."""

    def __init__(self, get_store: Callable[[], Any]) -> None:
        self._get_store = get_store

    def record(self, rows: list[dict[str, Any]]) -> None:
        store = self._get_store()
        if store is None or not rows:
            raise RuntimeError("the store is not available")
        columns = [[_db_value(name, row[name]) for row in rows] for name in ALERT_COLUMNS]
        store.insert("alerts", ALERT_COLUMNS, columns)


class JsonlHistory:
    """One JSON object per line in a file (for `alerts run --api`, whose API is read-only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def record(self, rows: list[dict[str, Any]]) -> None:
        with self._lock, open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")


class AlertRunner:
    """Evaluates a RuleSet against a QuerySource on a timer (or by hand with `evaluate`)."""

    def __init__(
        self,
        ruleset: RuleSet,
        source: QuerySource,
        *,
        history: History | None = None,
        sender: WebhookSender | None = None,
        description: str = "stepscope",
        external_url: str = "",
    ) -> None:
        self.ruleset = ruleset
        self.source = source
        self.history = history
        self.description = description
        self.external_url = external_url
        notify = ruleset.notify
        if sender is None and notify.webhook:
            sender = WebhookSender(
                notify.webhook,
                timeout_s=notify.timeout_s,
                max_attempts=notify.max_attempts,
                headers=dict(notify.headers),
            )
        self.sender = sender
        self.states = {r.name: AlertState(r.name) for r in ruleset.rules if not r.group_by}
        self.observations: dict[str, Observation] = {}
        self.rounds = 0
        self._firing_annotations: dict[str, dict[str, str]] = {}
        self._notify_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alert-notify")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> AlertRunner:
        """Start the sender and the evaluation thread."""
        if self.sender is not None and getattr(self.sender, "_thread", None) is None:
            self.sender.start()
        self._thread = threading.Thread(target=self._loop, name="alert-eval", daemon=True)
        self._thread.start()
        log.info(
            "%d alert rule(s), evaluated every %gs", len(self.ruleset.rules), self.ruleset.notify.interval_s
        )
        return self

    def stop(self) -> None:
        """Stop evaluating; deliver what is queued for a moment, then return."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._notify_pool.shutdown(wait=True, cancel_futures=False)
        if self.sender is not None:
            self.sender.stop()

    def _loop(self) -> None:
        # Rounds are stamped with their scheduled times, exactly `interval` apart, so that `for` is
        # reached at the round it should be, not one later because a round woke a millisecond early.
        interval = self.ruleset.notify.interval_s
        mono0, wall0 = time.monotonic(), time.time()
        k = 0
        while not self._stop.is_set():
            self.evaluate(wall0 + k * interval)
            k += 1
            delay = mono0 + k * interval - time.monotonic()
            if delay < 0:  # a round ran longer than the interval: skip ahead, never burst
                mono0, wall0, k, delay = time.monotonic(), time.time(), 0, 0.0
            if self._stop.wait(delay):
                return

    # --- one round ------------------------------------------------------------------------------------
    def evaluate(self, now: float | None = None) -> list[Transition]:
        """Observe every rule at `now` (default: the clock), advance the states, dispatch transitions."""
        now = time.time() if now is None else now
        transitions = []
        for rule in self._expanded(now):
            try:
                obs = observe(rule, self.source, now)
            except Exception as e:  # store down or slow: skip this rule this round, keep the state
                log.warning("alert rule %s: cannot evaluate: %s", rule.name, e)
                continue
            self.observations[rule.name] = obs
            state, transition = step(rule, self.states.setdefault(rule.name, AlertState(rule.name)), obs, now)
            self.states[rule.name] = state
            if transition is not None:
                transitions.append(transition)
                self._dispatch(rule, transition, obs)
        self.rounds += 1
        return transitions

    def _expanded(self, now: float) -> list[Rule]:
        """The rules, a grouped one as one copy per group seen in its window, and per group it watched
        before (so that a group that went quiet still resolves)."""
        out = []
        for rule in self.ruleset.rules:
            if not rule.group_by:
                out.append(rule)
                continue
            try:
                seen = groups(rule, self.source, now)
            except Exception as e:
                log.warning("alert rule %s: cannot list its groups: %s", rule.name, e)
                continue
            known = [n.split("/", 1)[1] for n in self.states if n.startswith(rule.name + "/")]
            values = dict.fromkeys([v for _, v in seen] + known)
            out += [rule.for_group(rule.group_by[0], v) for v in values]
        return out

    def _dispatch(self, rule: Rule, t: Transition, obs: Observation) -> None:
        value = "no data" if t.value is None else fmt_value(rule, t.value)
        if not t.notifies:
            log.info("alert %s %s -> %s (value %s)", rule.name, t.old, t.new, value)
            self._record(rule, t, obs, "", {})
            return
        self._notify_pool.submit(self._notify, rule, t, obs)

    def _notify(self, rule: Rule, t: Transition, obs: Observation) -> None:
        try:
            labels = self.labels(rule)
            if t.new == FIRING:
                ann, details = enrich.annotate(
                    rule,
                    t,
                    self.source,
                    interval_s=self.ruleset.notify.interval_s,
                    diagnosis_timeout_s=self.ruleset.notify.diagnosis_timeout_s,
                    description=self.description,
                )
                self._firing_annotations[rule.name] = ann
                log.warning("ALERT FIRING %s [%s]: %s | %s", rule.name, rule.severity, ann["summary"],
                            ann.get("breakdown", ""))  # fmt: skip
            else:
                ann = {**self._firing_annotations.pop(rule.name, {}), "summary": enrich.summary(rule, t)}
                details = {"summary": ann["summary"]}
                log.warning("ALERT RESOLVED %s [%s]: %s", rule.name, rule.severity, ann["summary"])
            if self.sender is not None:
                payload = alertmanager_payload(
                    t.new, labels, ann, t.active_at, t.at, external_url=self.external_url
                )
                self.sender.send(payload)
            self._record(rule, t, obs, ann["summary"], details)
        except Exception:  # a notification must never take the runner down
            log.exception("alert %s: building the %s notification failed", rule.name, t.new)

    def _record(self, rule: Rule, t: Transition, obs: Observation, summary: str, details: dict) -> None:
        if self.history is None:
            return
        row = {
            "time": t.at,
            "rule": rule.name,
            "state": t.new,
            "previous": t.old,
            "severity": rule.severity,
            "metric": rule.metric,
            "value": t.value,
            "threshold": rule.threshold,
            "requests": t.requests,
            "active_at": t.active_at,
            "labels": self.labels(rule),
            "summary": summary,
            "details": json.dumps({**details, "observation": dict(obs.detail)}, default=str),
        }
        try:
            self.history.record([row])
        except Exception as e:
            log.warning("alert %s: cannot record the %s transition: %s", rule.name, t.new, e)

    def labels(self, rule: Rule) -> dict[str, str]:
        """Alertmanager labels: alertname, severity, metric, the rule's filters and its own labels."""
        return {"alertname": rule.alertname or rule.name, "severity": rule.severity, "metric": rule.metric,
                **dict(rule.filters), **dict(rule.labels)}  # fmt: skip

    def restore(self, rows: list[list[Any]]) -> None:
        """Take up firing alerts from history rows `[rule, state, active_at, time]` (latest per rule), so a
        restarted collector neither fires them again nor forgets to resolve them."""
        grouped = tuple(r.name + "/" for r in self.ruleset.rules if r.group_by)
        for name, state, active_at, at in rows:
            if (name in self.states or name.startswith(grouped or ("\0",))) and state == FIRING:
                self.states[name] = AlertState(name, FIRING, _epoch(active_at), _epoch(at))
                log.info("alert %s: still firing since %s (from history)", name, active_at)


LATEST_STATES_SQL = (
    "SELECT rule, argMax(state, time), argMax(active_at, time), max(time) FROM alerts GROUP BY rule"
)


def _db_value(name: str, value: Any) -> Any:
    if name in ("time", "active_at") and value is not None:
        return dt.datetime.fromtimestamp(value, dt.UTC).replace(tzinfo=None)
    return value


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.UTC).timestamp() if value.tzinfo is None else value.timestamp()
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
