"""Pull engines' Prometheus `/metrics` pages on a schedule into `engine_samples`.

    targets --HTTP GET every interval--> text --mapped lines--> prometheus_client's parser --> rows
    rows of every target, buffered --one insert per round--> engine_samples

Only families with a stepscope name (collector/engine_names.py) are parsed and stored; lines that are not
metric samples at all reach the parser, so a page of garbage fails with the parser's own error. A target
that is down or answers garbage is logged and retried with backoff (the interval, doubling per failure up
to BACKOFF_MAX_S); it never stops the collector or the other targets. Each scrape also stores, as
Prometheus does, `up` (1 or 0, the error in the label `error`) and `scrape_samples` for its instance, so
scrape health is a query (`stepscope query scrape-health`) as well as part of `/health`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from collector.engine_names import stepscope_name

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 60.0
BUFFER_MAX_ROWS = 1_000_000  # rows kept while the store is down; past it the oldest round is dropped
MAX_PAGE_BYTES = 16 << 20
COLUMNS = ("time", "service", "instance", "metric", "value", "labels", "source_metric", "origin")
DEFAULT_SERVICE = "engine"


class ScrapeError(Exception):
    """A page could not be fetched or parsed."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One `/metrics` URL and how its samples are labelled. `instance` defaults to the URL's host:port,
    as in Prometheus."""

    url: str
    instance: str = ""
    service: str = DEFAULT_SERVICE
    bearer_token: str | None = None

    def __post_init__(self) -> None:
        url = urlparse(self.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"scrape target {self.url!r} is not an http(s) URL")
        if not self.instance:
            port = url.port or (443 if url.scheme == "https" else 80)
            object.__setattr__(self, "instance", f"{url.hostname}:{port}")
        if not self.service:
            object.__setattr__(self, "service", DEFAULT_SERVICE)


@dataclass(slots=True)
class TargetHealth:
    """What `/health` shows for one target."""

    url: str
    instance: str
    service: str
    up: bool = False
    last_error: str = ""
    last_scrape: float | None = None  # epoch seconds of the last attempt
    last_success: float | None = None
    samples: int = 0  # samples stored from the last successful scrape
    scrapes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    next_delay_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def parse_exposition(text: str, memo: dict[str, Any] | None = None) -> list[Sample]:
    """(stepscope metric, value, labels, exposed name) of every mapped sample of a Prometheus text page.
    Raises ScrapeError when the page is not Prometheus text exposition.

    prometheus_client's parser reads each distinct series (name and labels) once; `memo` keeps what it
    read, so a page that repeats the series of the previous scrape costs a dict lookup and a float() a
    line (the library's parser walks labels a character at a time, ~0.2 ms a labelled line)."""
    memo = {} if memo is None else memo
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#" or line.isspace():
            continue
        cut = line.rfind("}") + 1 or _name_end(line)
        series = line[:cut]
        hit = memo.get(series)
        if hit is None:
            hit = memo[series] = _parse_series(series)
            if len(memo) > MEMO_MAX:
                memo.clear()
        fields = line[cut:].split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            raise ScrapeError(f"not Prometheus text exposition: bad value in {line[:120]!r}") from None
        if hit is not _UNMAPPED:
            out.append((hit[0], value, dict(hit[1]), hit[2]))
    return out


Sample = tuple[str, float, dict[str, str], str]
MEMO_MAX = 200_000
_UNMAPPED: Any = ()


def _name_end(line: str) -> int:
    for i, ch in enumerate(line):
        if ch in " \t":
            return i
    return len(line)


def _parse_series(series: str) -> Any:
    """(stepscope name, labels, exposed name) of one series as prometheus_client's parser reads it, or
    _UNMAPPED. Raises ScrapeError with the parser's message when it is not a series."""
    try:
        families = list(text_string_to_metric_families(series + " 0\n"))
        sample = families[0].samples[0]
    except Exception as e:  # the parser raises ValueError, IndexError, ... on text it cannot read
        detail = str(e).removesuffix(" 0")[:200] or f"{type(e).__name__} in {series[:120]!r}"
        raise ScrapeError(f"not Prometheus text exposition: {detail}") from None
    name = stepscope_name(sample.name)
    return _UNMAPPED if name is None else (name, tuple(sample.labels.items()), sample.name)


class Scraper:
    """Scrapes `targets` every `interval_s` on one background thread and inserts what it reads with
    `insert(table)` (an Arrow table with COLUMNS), once per round. `insert` raising keeps the rows buffered
    for the next round."""

    def __init__(
        self,
        targets: list[ScrapeTarget],
        interval_s: float,
        insert: Callable[[pa.Table], None],
        *,
        timeout_s: float | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("the scrape interval must be positive")
        self.targets = list(targets)
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(10.0, interval_s)
        self._insert = insert
        self.health = {t.url: TargetHealth(t.url, t.instance, t.service) for t in self.targets}
        self._memos: dict[str, dict[str, Any]] = {t.url: {} for t in self.targets}
        self._rows: list[list[Any]] = [[] for _ in COLUMNS]
        self._rounds: list[int] = []  # row count of each buffered round, oldest first
        self._lock = threading.Lock()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dropped_rows = 0
        self.insert_error = ""

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="scrape", daemon=True)
        self._thread.start()
        ready.wait(timeout=10)

    def stop(self) -> None:
        """Stop scraping and insert what is buffered (once)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.flush()

    def status(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "targets": [h.as_dict() for h in self.health.values()],
            "buffered_rows": sum(self._rounds),
            "dropped_rows": self.dropped_rows,
            "insert_error": self.insert_error,
        }

    # --- the loop -------------------------------------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        ready.set()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=max(10, len(self.targets)), max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            tasks = [asyncio.create_task(self._target_loop(client, t, i)) for i, t in enumerate(self.targets)]
            flusher = asyncio.create_task(self._flush_loop())
            assert self._stop is not None
            await self._stop.wait()
            for task in (*tasks, flusher):
                task.cancel()
            await asyncio.gather(*tasks, flusher, return_exceptions=True)

    async def _target_loop(self, client: httpx.AsyncClient, target: ScrapeTarget, index: int) -> None:
        # spread the targets over the interval so that they are not all fetched at once
        await asyncio.sleep(self.interval_s * index / max(1, len(self.targets)))
        health = self.health[target.url]
        while True:
            started = time.monotonic()
            await self.scrape_once(client, target)
            delay = self.interval_s
            if health.consecutive_failures:
                delay = min(BACKOFF_MAX_S, self.interval_s * 2 ** (health.consecutive_failures - 1))
            health.next_delay_s = delay
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - started)))

    async def scrape_once(self, client: httpx.AsyncClient, target: ScrapeTarget) -> None:
        """Fetch, parse and buffer one page; record the outcome in `health` (never raises)."""
        health = self.health[target.url]
        now_ns = time.time_ns()
        health.last_scrape = now_ns / 1e9
        health.scrapes += 1
        try:
            samples = parse_exposition(await self._fetch(client, target), self._memos[target.url])
        except ScrapeError as e:
            self._failed(target, health, str(e), now_ns)
            return
        except Exception as e:  # a scrape must never end its target's loop
            self._failed(target, health, f"{type(e).__name__}: {e}", now_ns)
            return
        if health.consecutive_failures:
            log.info("scrape target %s is back after %d failures", target.url, health.consecutive_failures)
        health.up, health.last_error, health.last_success = True, "", now_ns / 1e9
        health.samples, health.consecutive_failures = len(samples), 0
        rows = [(m, v, labels, src) for m, v, labels, src in samples]
        rows.append(("up", 1.0, {}, "up"))
        rows.append(("scrape_samples", float(len(samples)), {}, "scrape_samples"))
        self._buffer(target, now_ns, rows)

    async def _fetch(self, client: httpx.AsyncClient, target: ScrapeTarget) -> str:
        headers = {"Accept": "text/plain;version=0.0.4"}
        if target.bearer_token:
            headers["Authorization"] = f"Bearer {target.bearer_token}"
        try:
            response = await client.get(target.url, headers=headers)
        except httpx.HTTPError as e:
            raise ScrapeError(f"{type(e).__name__}: {str(e) or 'the connection closed'}") from None
        if response.status_code != 200:
            raise ScrapeError(f"HTTP {response.status_code}: {response.text[:200].strip()}")
        if len(response.content) > MAX_PAGE_BYTES:
            raise ScrapeError(f"page of {len(response.content)} bytes is over {MAX_PAGE_BYTES}")
        return response.text

    def _failed(self, target: ScrapeTarget, health: TargetHealth, error: str, now_ns: int) -> None:
        if health.up or not health.consecutive_failures:
            log.warning("scrape target %s failed: %s (retrying with backoff)", target.url, error)
        health.up, health.last_error = False, error
        health.failures += 1
        health.consecutive_failures += 1
        self._buffer(target, now_ns, [("up", 0.0, {"error": error[:500]}, "up")])

    def _buffer(self, target: ScrapeTarget, now_ns: int, rows: list[tuple]) -> None:
        n = len(rows)
        with self._lock:
            cols = self._rows
            cols[0].extend([now_ns] * n)
            cols[1].extend([target.service] * n)
            cols[2].extend([target.instance] * n)
            for m, v, labels, src in rows:
                cols[3].append(m)
                cols[4].append(v)
                cols[5].append(labels)
                cols[6].append(src)
            cols[7].extend(["scrape"] * n)
            self._rounds.append(n)
            while sum(self._rounds) > BUFFER_MAX_ROWS and len(self._rounds) > 1:
                old = self._rounds.pop(0)
                for col in cols:
                    del col[:old]
                self.dropped_rows += old

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.get_running_loop().run_in_executor(None, self.flush)

    def flush(self) -> int:
        """Insert the buffered rows (all targets, one insert); on failure keep them. Returns rows inserted."""
        with self._lock:
            if not self._rounds:
                return 0
            columns, self._rows = self._rows, [[] for _ in COLUMNS]
            rounds, self._rounds = self._rounds, []
        try:
            self._insert(to_arrow(columns))
        except Exception as e:  # the store is down or refused: keep the rows for the next round
            self.insert_error = str(e)[:500]
            log.warning("inserting %d scraped samples failed: %s", sum(rounds), self.insert_error)
            with self._lock:
                for old, new in zip(columns, self._rows, strict=True):
                    old.extend(new)
                self._rows, self._rounds = columns, rounds + self._rounds
            return 0
        self.insert_error = ""
        return sum(rounds)


def to_arrow(columns: list[list[Any]]) -> pa.Table:
    """The buffered columns (COLUMNS order, times in epoch ns) as the Arrow table `engine_samples` takes."""
    labels = [list(d.items()) for d in columns[5]]
    return pa.table(
        {
            "time": pa.array(columns[0], pa.timestamp("ns")),
            "service": pa.array(columns[1], pa.string()),
            "instance": pa.array(columns[2], pa.string()),
            "metric": pa.array(columns[3], pa.string()),
            "value": pa.array(columns[4], pa.float64()),
            "labels": pa.array(labels, pa.map_(pa.string(), pa.string())),
            "source_metric": pa.array(columns[6], pa.string()),
            "origin": pa.array(columns[7], pa.string()),
        }
    )
