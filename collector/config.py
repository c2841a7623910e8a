"""The collector's settings: every default lives here; the CLI is built from this dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

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
            "help": "processes converting spans to columns beside the receiver (0: in it; on a machine with "
            "no core to spare 0 costs less CPU: docs/collector.md)"
        },
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
        if self.query_timeout_s <= 0 or self.ttl_days < 0 or self.convert_workers < 0:
            raise ValueError("query_timeout_s must be positive, ttl_days and convert_workers not negative")
        if self.spool is None:
            self.spool = (
                os.path.join(target.path, "spool")
                if target.kind == "chdb" and target.path != ":memory:"
                else os.path.abspath("stepscope-spool")
            )

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}
