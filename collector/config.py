"""The collector's settings: every default lives here; the CLI is built from this dataclass."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields

from collector.scrape import ScrapeTarget
from collector.store import DEFAULT_DSN, parse_dsn


@dataclass(slots=True)
class CollectorConfig:
    """Settings of one `stepscope collector` process."""

    store: str = field(
        default=DEFAULT_DSN, metadata={"help": "chdb:///dir (embedded) or http(s)://user:pass@host:8123/db"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=4318, metadata={"help": "port to listen on (4318 is OTLP/HTTP's)"})
    token: str | None = field(
        default=None, metadata={"help": "require 'Authorization: Bearer TOKEN' on ingest and /api"}
    )
    spool: str | None = field(
        default=None,
        metadata={"help": "spool directory (default: DIR/spool for chdb://DIR, ./stepscope-spool otherwise)"},
    )
    spool_max_bytes: int = field(
        default=1 << 30, metadata={"help": "spool bound; past it ingest answers 503"}
    )
    max_body_bytes: int = field(
        default=32 << 20, metadata={"help": "request size limit, compressed and not (413 past it)"}
    )
    max_inflight: int = field(default=64, metadata={"help": "concurrent ingest requests before 429"})
    ttl_days: int = field(
        default=0, metadata={"help": "drop data older than this many days (0: keep; set at table creation)"}
    )
    query_max_rows: int = field(default=10_000, metadata={"help": "row limit of /api/sql"})
    query_timeout_s: float = field(default=30.0, metadata={"help": "time limit of /api/sql and /api queries"})
    retry_after_s: int = field(default=2, metadata={"help": "Retry-After sent with 429 and 503"})
    convert_workers: int = field(
        default=1,
        metadata={
            "help": "processes converting spans to columns beside the receiver where the compiled span "
            "decoder cannot be built (no C compiler); unused otherwise (docs/collector.md)"
        },
    )

    scrape: str = field(
        default="",
        metadata={"help": "Prometheus /metrics URLs to scrape into engine_samples, comma-separated"},
    )
    scrape_interval: str = field(default="5s", metadata={"help": "how often to scrape each target"})
    assemble_grace_s: float = field(
        default=10.0,
        metadata={
            "help": "an SGLang request trace goes into requests this long after its request span ends (its "
            "stage spans come from other processes)"
        },
    )
    config: str | None = field(
        default=None,
        metadata={"help": "a TOML file with [[scrape]] entries (url, instance, service, bearer_token)"},
    )

    def __post_init__(self) -> None:
        target = parse_dsn(self.store)  # raises ValueError on a bad DSN
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.token is not None and not self.token.strip():
            raise ValueError("an empty --token would lock nothing")
        for name in ("spool_max_bytes", "max_body_bytes", "max_inflight", "query_max_rows", "retry_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.assemble_grace_s < 0:
            raise ValueError("assemble_grace_s must not be negative")
        if self.query_timeout_s <= 0 or self.ttl_days < 0 or self.convert_workers < 0:
            raise ValueError("query_timeout_s must be positive, ttl_days and convert_workers not negative")
        self.scrape_targets()  # raises ValueError on a bad URL, file or interval
        if self.spool is None:
            self.spool = (
                os.path.join(target.path, "spool")
                if target.kind == "chdb" and target.path != ":memory:"
                else os.path.abspath("stepscope-spool")
            )

    @property
    def scrape_interval_s(self) -> float:
        """Seconds between two scrapes of a target (`scrape_interval` in the config file wins)."""
        from alerting.rules import parse_duration

        text = _load_toml(self.config).get("scrape_interval", self.scrape_interval) if self.config else None
        seconds = parse_duration(text if text is not None else self.scrape_interval)
        if seconds <= 0:
            raise ValueError("the scrape interval must be positive")
        return seconds

    def scrape_targets(self) -> list[ScrapeTarget]:
        """The targets of --scrape and of the config file's [[scrape]] entries (ValueError when bad)."""
        targets = [ScrapeTarget(url.strip()) for url in self.scrape.split(",") if url.strip()]
        if self.config:
            entries = _load_toml(self.config).get("scrape", [])
            if not isinstance(entries, list):
                raise ValueError(f"{self.config}: 'scrape' must be a list of [[scrape]] tables")
            targets += [_target(self.config, i, entry) for i, entry in enumerate(entries)]
        urls = [t.url for t in targets]
        if len(set(urls)) != len(urls):
            raise ValueError("a scrape target is listed twice")
        if targets:
            self.scrape_interval_s  # noqa: B018 -- validates the interval
        return targets

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def _load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from None


def _target(path: str, index: int, entry: object) -> ScrapeTarget:
    fields_ = {"url", "instance", "service", "bearer_token"}
    if not isinstance(entry, dict) or set(entry) - fields_ or not isinstance(entry.get("url"), str):
        raise ValueError(
            f"{path}: [[scrape]] #{index + 1} needs a url and takes only url, instance, service, bearer_token"
        )
    return ScrapeTarget(**{k: str(v) for k, v in entry.items()})
