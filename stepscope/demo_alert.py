"""The demo's alert: one TTFT P99 rule evaluated by `alerting.AlertRunner` on the collector's API, posting
Alertmanager webhooks to a receiver in the demo process, which prints them as they arrive; and the TTFT
readings (`ttft_since`) its threshold and the demo's progress lines come from.

The rule is written to `DIR/rules.toml` (the same file works with `stepscope collector --alert-rules` or
`stepscope alerts run`); transitions go to `DIR/alerts.jsonl` (the collector's API is read-only, so the
`alerts` table is not written from here).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RULE = "ttft-p99"
RULES = """\
# Written by `stepscope demo`: threshold {why}.
[notify]
webhook = "http://127.0.0.1:{port}/hook"
interval = "{interval}"
diagnosis_timeout = "30s"

[[rule]]
name = "{rule}"
metric = "ttft"
percentile = 99
threshold = "{threshold:g}s"
window = "{window}"
for = "{hold}"
min_requests = 10
severity = "page"
"""


class AlertWatch:
    """A TTFT P99 alert on a running collector whose notifications are printed."""

    def __init__(
        self,
        collector_url: str,
        threshold_s: float,
        out: Path,
        printer: Callable[[str], None],
        *,
        why: str = "",
        interval: str = "5s",
        window: str = "30s",
        hold: str = "10s",
    ) -> None:
        self.collector_url = collector_url
        self.threshold_s = threshold_s
        self.out = out
        self.say = printer
        self.why = why
        self.interval, self.window, self.hold = interval, window, hold
        self.received: list[dict[str, Any]] = []  # the webhook payloads, in arrival order
        self.peak = 0.0  # the highest TTFT P99 the demo's progress lines saw (for "did not fire")
        self._server: ThreadingHTTPServer | None = None
        self._runner: Any = None
        self._reader: Any = None

    def start(self) -> AlertWatch:
        """Start the receiver, write the rule, start evaluating."""
        from alerting.rules import parse_rules
        from alerting.runner import AlertRunner, JsonlHistory
        from collector.client import ApiReader

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self._server.serve_forever, name="demo-webhook", daemon=True).start()
        text = RULES.format(
            port=self._server.server_address[1], rule=RULE, threshold=self.threshold_s,
            interval=self.interval, window=self.window, hold=self.hold, why=self.why,
        )  # fmt: skip
        path = self.out / "rules.toml"
        path.write_text(text)
        self._reader = ApiReader(self.collector_url, timeout_s=30)
        self._runner = AlertRunner(
            parse_rules(text, str(path)),
            self._reader,
            history=JsonlHistory(str(self.out / "alerts.jsonl")),
            description="stepscope demo",
            external_url=self.collector_url,
        ).start()
        return self

    def state(self) -> str:
        """The rule's state now: inactive, pending, firing or resolved."""
        return self._runner.states[RULE].state if self._runner is not None else "not armed"

    @property
    def fired(self) -> bool:
        return any(p.get("status") == "firing" for p in self.received)

    def finish(self) -> None:
        """Stop evaluating (a notification being built is still delivered); say so if nothing fired."""
        self._stop_runner()
        if not self.fired:
            self.say(
                f"\n  the alert did not fire: TTFT P99 peaked at {self.peak:.2f}s against a threshold of "
                f"{self.threshold_s:g}s held for {self.hold} (history: {self.out / 'alerts.jsonl'})"
            )

    def close(self) -> None:
        """Stop the runner and the receiver (idempotent)."""
        self._stop_runner()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _stop_runner(self) -> None:
        if self._runner is not None:
            self._runner.stop()
            self._runner = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        watch = self

        class Hook(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.end_headers()
                try:
                    payload = json.loads(body)
                except ValueError:
                    return
                watch.received.append(payload)
                watch.say(describe(payload))

        return Hook


def describe(payload: dict[str, Any]) -> str:
    """An Alertmanager webhook payload as the few lines the demo prints."""
    lines = []
    for alert in payload.get("alerts", []):
        labels, ann = alert.get("labels", {}), alert.get("annotations", {})
        at = alert.get("startsAt") if alert.get("status") == "firing" else alert.get("endsAt")
        lines.append(
            f"\n  >>> ALERT {alert.get('status', '?').upper()} {labels.get('alertname')} "
            f"[{labels.get('severity')}], {'active since' if alert.get('status') == 'firing' else 'ended'} "
            f"{_local(at)} (webhook received)"
        )
        lines.append(f"      {ann.get('summary', '')}")
        if alert.get("status") == "firing":
            if ann.get("breakdown"):
                lines.append(f"      breakdown: {ann['breakdown']}")
            findings = (ann.get("findings") or "").strip().splitlines()
            lines.append(
                "      findings attached to the alert:" if findings else "      no findings attached"
            )
            lines += [f"        {line}" for line in findings]
    return "\n".join(lines)


def _local(iso: str | None) -> str:
    if not iso:
        return "?"
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone().strftime("%H:%M:%S")
    except ValueError:
        return iso


def ttft_since(reader: Any, since: float) -> tuple[int, float, float]:
    """(requests finished since `since`, TTFT P50, TTFT P99) from the collector's `requests`."""
    sql = (
        "SELECT count(), quantileExact(0.5)(ttft_s), quantileExact(0.99)(ttft_s) FROM requests "
        "WHERE end_time >= fromUnixTimestamp64Nano(toInt64({since:Float64} * 1e9))"
    )
    try:
        n, p50, p99 = reader.query(sql, {"since": since}).rows[0]
    except Exception:  # the collector is busy or a query timed out: skip this line
        return 0, 0.0, 0.0
    return int(n), float(p50 or 0.0), float(p99 or 0.0)
