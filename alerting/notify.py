"""Notifications: Alertmanager's webhook JSON, posted by a background thread with retries and backoff.

`WebhookSender.send(payload)` only puts the payload on a bounded queue and returns; one thread posts in
order (so a resolved never overtakes its firing), retrying each payload with exponential backoff up to
`max_attempts`. A slow or dead receiver therefore delays only other notifications, never the evaluation
or ingest; when the queue is full the oldest payload is dropped and counted.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import logging
import threading
from typing import Any

import httpx

log = logging.getLogger(__name__)

ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's "no end yet"
QUEUE_MAX = 256
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 60.0


def iso(t: float | None) -> str:
    """Unix seconds as RFC 3339 UTC (Alertmanager's time format); ZERO_TIME for None."""
    if t is None:
        return ZERO_TIME
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fingerprint(labels: dict[str, str]) -> str:
    """A stable id of an alert from its labels (16 hex digits, as Alertmanager shows them)."""
    text = "\x00".join(f"{k}\x00{v}" for k, v in sorted(labels.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def alertmanager_payload(
    status: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    starts_at: float | None,
    ends_at: float | None,
    *,
    receiver: str = "stepscope",
    external_url: str = "",
    generator_url: str = "",
) -> dict[str, Any]:
    """The body Alertmanager posts to a webhook receiver (version 4) for one alert. `status` is "firing" or
    "resolved"; labels carry `alertname` and `severity`; annotation values are strings."""
    alert = {
        "status": status,
        "labels": dict(labels),
        "annotations": {k: str(v) for k, v in annotations.items()},
        "startsAt": iso(starts_at),
        "endsAt": iso(ends_at) if status == "resolved" else ZERO_TIME,
        "generatorURL": generator_url,
        "fingerprint": fingerprint(labels),
    }
    group = {"alertname": labels["alertname"]}
    return {
        "version": "4",
        "groupKey": "{}:{alertname=" + json.dumps(labels["alertname"]) + "}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": group,
        "commonLabels": dict(labels),
        "commonAnnotations": dict(alert["annotations"]),
        "externalURL": external_url,
        "alerts": [alert],
    }


class WebhookSender:
    """Posts payloads to one URL from a background thread; `send` never blocks."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        max_attempts: int = 8,
        headers: dict[str, str] | None = None,
        backoff_first_s: float = BACKOFF_FIRST_S,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self.url = url
        self.max_attempts = max_attempts
        self.backoff_first_s = backoff_first_s
        self.backoff_max_s = backoff_max_s
        self._http = httpx.Client(timeout=timeout_s, headers=headers or {})
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"sent": 0, "attempts": 0, "failed_attempts": 0, "given_up": 0, "dropped": 0}
        self.backoffs: collections.deque[float] = collections.deque(maxlen=64)  # the last waits, seconds

    def start(self) -> WebhookSender:
        """Start the sending thread."""
        self._thread = threading.Thread(target=self._loop, name="alert-webhook", daemon=True)
        self._thread.start()
        return self

    def send(self, payload: dict[str, Any]) -> None:
        """Queue `payload` for delivery and return at once."""
        with self._cond:
            if len(self._queue) >= QUEUE_MAX:
                self._queue.popleft()
                self.stats["dropped"] += 1
                log.warning("alert webhook queue full: dropped the oldest notification")
            self._queue.append(payload)
            self._cond.notify()

    def pending(self) -> int:
        """Payloads not yet delivered or given up on."""
        with self._cond:
            return len(self._queue)

    def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Try to deliver what is queued for up to `flush_timeout_s`, then stop (the rest is dropped)."""
        if self._thread is not None:
            with self._cond:
                self._cond.wait_for(lambda: not self._queue, timeout=flush_timeout_s)
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            self._thread.join(timeout=10)
        self._http.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop.is_set())
                if self._stop.is_set():
                    return
                payload = self._queue[0]
            self._deliver(payload)
            with self._cond:
                if self._queue and self._queue[0] is payload:
                    self._queue.popleft()
                self._cond.notify_all()

    def _deliver(self, payload: dict[str, Any]) -> bool:
        name = payload["alerts"][0]["labels"].get("alertname", "?")
        delay = self.backoff_first_s
        for attempt in range(1, self.max_attempts + 1):
            self.stats["attempts"] += 1
            try:
                r = self._http.post(self.url, json=payload)
                if r.status_code < 300:
                    self.stats["sent"] += 1
                    log.info("alert %s %s delivered to %s", name, payload["status"], self.url)
                    return True
                problem = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            self.stats["failed_attempts"] += 1
            if attempt == self.max_attempts:
                break
            log.warning(
                "alert %s %s: webhook %s failed (%s), attempt %d/%d, retrying in %.1fs",
                name, payload["status"], self.url, problem, attempt, self.max_attempts, delay,
            )  # fmt: skip
            self.backoffs.append(delay)
            if self._stop.wait(delay):
                return False
            delay = min(delay * 2, self.backoff_max_s)
        self.stats["given_up"] += 1
        log.error("alert %s %s: webhook %s gave up after %d attempts", name, payload["status"], self.url,
                  self.max_attempts)  # fmt: skip
        return False
