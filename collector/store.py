"""The one door to stepscope's ClickHouse: open a store by DSN, migrate it, insert columns, run queries.

    from collector.store import Store
    with Store.open("chdb:///path/to/dir") as store:        # or "http://user:pass@host:8123/db"
        result = store.query("SELECT service, quantile(0.99)(ttft_s) FROM requests GROUP BY service")
        result.columns, result.rows                          # ["service", ...], [["engine", 0.21], ...]
        store.query("SELECT count() FROM steps WHERE service = {s:String}", {"s": "engine"})
        store.query_readonly(untrusted_sql, max_rows=1000, timeout_s=10)   # ClickHouse readonly=1

Both kinds of DSN go through clickhouse-connect (its chDB backend for `chdb://`), so one schema and one code
path serve the embedded engine and a server. chDB allows one process per data directory: while a collector
runs, other programs query through its HTTP API (`collector.client`), not through this module.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlparse

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError

from collector import engine_names

log = logging.getLogger(__name__)

DEFAULT_DSN = "chdb://./stepscope-data"
MIGRATIONS_TABLE = "stepscope_schema_migrations"
DEDUP_WINDOW = 10_000  # block hashes kept per table: how far back a replayed batch is still recognised
_TTL_COLUMNS = {
    "ttl_traces": "toDateTime(Timestamp)",
    "ttl_trace_id_ts": "toDateTime(Start)",
    "ttl_metrics": "toDateTime(TimeUnix)",
    "ttl_logs": "TimestampTime",
    "ttl_requests": "toDateTime(time)",
    "ttl_steps": "toDateTime(time)",
    "ttl_engine_samples": "toDateTime(time)",
}


class StoreError(Exception):
    """The store failed (unreachable, locked by another process, out of space)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached right now; retrying later may succeed."""


class QueryError(ValueError):
    """The query is wrong or not allowed (syntax, unknown table, a write under readonly)."""


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Column names and rows (lists, in column order) of one query."""

    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = False

    def dicts(self) -> list[dict[str, Any]]:
        """Rows as {column: value}; convenient for small results."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed DSN: an embedded chDB directory, or a server's connection arguments."""

    kind: str  # "chdb" | "server"
    path: str = ""
    connect_args: tuple[tuple[str, Any], ...] = ()
    database: str = "default"

    @property
    def description(self) -> str:
        if self.kind == "chdb":
            return f"chdb://{self.path}"
        args = dict(self.connect_args)
        scheme = "https" if args.get("secure") else "http"
        return f"{scheme}://{args['host']}:{args['port']}/{self.database}"


def parse_dsn(dsn: str) -> Target:
    """`chdb:///abs/dir`, `chdb://./rel/dir`, `chdb://memory`, or `http(s)://user:pass@host:port/db`."""
    if dsn.startswith("chdb://"):
        path = dsn[len("chdb://") :]
        if path in ("", "memory", ":memory:"):
            return Target("chdb", ":memory:")
        return Target("chdb", os.path.realpath(os.path.expanduser(path)))
    url = urlparse(dsn)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(
            f"unsupported store DSN {dsn!r}: use chdb:///dir or http(s)://user:pass@host:8123/db"
        )
    database = unquote(url.path.strip("/")) or "default"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", database):
        raise ValueError(f"database name {database!r} in the DSN is not a plain identifier")
    args = {
        "host": url.hostname,
        "port": url.port or (8443 if url.scheme == "https" else 8123),
        "username": unquote(url.username or "default"),
        "password": unquote(url.password or ""),
        "secure": url.scheme == "https",
    }
    return Target("server", connect_args=tuple(args.items()), database=database)


def redact(dsn: str) -> str:
    """The DSN without its password, for logs and error messages."""
    return re.sub(r"(//[^:/@]+:)[^@]*@", r"\1***@", dsn)


class Store:
    """A connection to stepscope's tables. Thread-safe: inserts and queries may come from several threads.

    `open()` connects and applies pending migrations; `insert()` takes columns and an optional
    de-duplication token (a replayed batch with the same token is stored once); `query()` runs trusted,
    parameterized SQL; `query_readonly()` runs untrusted SQL under ClickHouse's `readonly=1`.
    """

    def __init__(self, target: Target, writer: Any, reader: Any) -> None:
        self.target = target
        self._writer = writer
        self._reader = reader  # separate session: readonly and limits are session settings
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------------------
    @classmethod
    def open(cls, dsn: str = DEFAULT_DSN, *, ttl_days: int | None = None, migrate: bool = True) -> Store:
        """Connect to `dsn` and (by default) bring the schema up to date. Raises StoreUnavailable when
        a server does not answer, StoreError when chDB's directory is held by another process."""
        target = parse_dsn(dsn)
        writer = _connect(target)
        try:
            reader = _connect(target)
            store = cls(target, writer, reader)
            if migrate:
                store.migrate(ttl_days=ttl_days)
            return store
        except BaseException:
            writer.close()
            raise

    def close(self) -> None:
        """Release the connections (and, for chDB, the directory lock once no client holds it)."""
        for client in (self._reader, self._writer):
            try:
                client.close()
            except Exception:  # closing must never mask the error that led here
                log.debug("closing a client failed", exc_info=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema ---------------------------------------------------------------------------------------
    def migrate(self, *, ttl_days: int | None = None) -> list[str]:
        """Apply the .sql migrations not yet recorded; returns the names applied. Every statement is
        idempotent (IF NOT EXISTS), so a migration cut short by a crash is simply run again."""
        self.command(
            f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (version UInt32, name String, checksum String, "
            "applied_at DateTime DEFAULT now()) ENGINE = MergeTree ORDER BY version"
        )
        done = {row[0] for row in self.query(f"SELECT version FROM {MIGRATIONS_TABLE}").rows}
        applied = []
        for version, name, text in migrations():
            if version in done:
                continue
            for statement in split_statements(render_migration(text, ttl_days)):
                self.command(statement)
            checksum = hashlib.sha256(text.encode()).hexdigest()[:16]
            self.insert(MIGRATIONS_TABLE, ["version", "name", "checksum"], [[version], [name], [checksum]])
            applied.append(name)
            log.info("applied migration %s", name)
        return applied

    def schema_version(self) -> int:
        """The highest migration applied."""
        return int(self.query(f"SELECT max(version) FROM {MIGRATIONS_TABLE}").rows[0][0])

    # --- writes ---------------------------------------------------------------------------------------
    def insert(
        self,
        table: str,
        column_names: list[str] | tuple[str, ...],
        columns: list[list[Any]] | pa.Table,
        *,
        token: str | None = None,
    ) -> None:
        """Insert column-oriented data: a list of columns in `column_names` order, or an Arrow table (its
        own column names; ClickHouse parses Arrow natively, with no per-value Python work). With `token`, a
        second insert with the same token (a replay after a crash or a lost reply) is dropped by
        ClickHouse, here and in the materialized views it feeds."""
        arrow = isinstance(columns, pa.Table)
        if (columns.num_rows == 0) if arrow else (not columns or not columns[0]):
            return
        # The views an insert feeds (steps, requests, trace ids) fill on threads of their own beside it, not
        # one after another: on 2 cores the OTLP benchmark's spans/s rose 7-20% at the same CPU a span.
        settings: dict[str, Any] = {"parallel_view_processing": 1}
        if token:
            settings["insert_deduplication_token"] = f"{token}:{table}"
            settings["deduplicate_blocks_in_dependent_materialized_views"] = 1
        with self._write_lock:
            try:
                if arrow and self.target.kind == "chdb":
                    names, body = columns.schema.names, _arrow_stream(columns)
                    self._writer.raw_insert(table, names, body, settings, "ArrowStream")
                elif arrow:
                    self._writer.insert_arrow(table, columns, settings=settings)
                else:
                    self._writer.insert(
                        table,
                        columns,
                        column_names=list(column_names),
                        column_oriented=True,
                        settings=settings,
                    )
            except OperationalError as e:
                raise StoreUnavailable(f"store {self.target.description} unreachable: {e}") from e
            except ClickHouseError as e:
                raise StoreError(f"insert into {table} failed: {_first_line(e)}") from e

    def command(self, sql: str, parameters: dict[str, Any] | None = None) -> None:
        """Run trusted DDL or DML (schema changes, maintenance)."""
        with self._write_lock:
            try:
                self._writer.command(sql, parameters=parameters)
            except OperationalError as e:
                raise StoreUnavailable(f"store {self.target.description} unreachable: {e}") from e

    # --- reads ----------------------------------------------------------------------------------------
    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        """Run trusted SQL with server-side parameters (`{name:Type}` placeholders, never string pasting)."""
        with self._write_lock:
            return _run(self._writer, sql, parameters)

    def query_readonly(
        self,
        sql: str,
        *,
        max_rows: int = 10_000,
        timeout_s: float = 30.0,
        parameters: dict[str, Any] | None = None,
    ) -> QueryResult:
        """Run untrusted SQL under ClickHouse's readonly=1, with a time and a row limit. Writes, DDL, table
        functions that reach files or the network, and changing settings are refused by ClickHouse
        itself (QueryError). Rows past `max_rows` are cut and `truncated` is set."""
        with self._read_lock:
            self._arm_reader(max_rows, timeout_s)
            result = _run(self._reader, sql, parameters, max_rows=max_rows)
        return result

    def _arm_reader(self, max_rows: int, timeout_s: float) -> None:
        limits = (max_rows, timeout_s)
        if getattr(self, "_reader_limits", None) == limits:
            return
        if getattr(self, "_reader_limits", None) is not None:
            # readonly=1 forbids changing limits on this session: start a fresh one.
            self._reader.close()
            self._reader = _connect(self.target)
        settings = {
            "max_execution_time": timeout_s,
            "max_result_rows": max_rows + 1,
            "result_overflow_mode": "break",
            "readonly": 1,  # last: once set, the session can change nothing else
        }
        for key, value in settings.items():
            self._reader.set_client_setting(key, value)
        self._reader_limits = limits


def migrations() -> list[tuple[int, str, str]]:
    """(version, file name, text) of every migration shipped in collector/sql, in order."""
    out = []
    for entry in resources.files("collector").joinpath("sql").iterdir():
        m = re.fullmatch(r"(\d+)_\w+\.sql", entry.name)
        if m:
            out.append((int(m.group(1)), entry.name, entry.read_text()))
    return sorted(out)


def render_migration(text: str, ttl_days: int | None) -> str:
    """Fill the placeholders of a migration: TTL clauses from an integer, the dedup window setting."""
    days = int(ttl_days) if ttl_days else 0
    values = {
        key: (f"TTL {column} + toIntervalDay({days})" if days > 0 else "")
        for key, column in _TTL_COLUMNS.items()
    }
    values["dedup"] = f", non_replicated_deduplication_window = {DEDUP_WINDOW}"
    values |= engine_names.sql_maps()
    return re.sub(r"\{(ttl_\w+|dedup|engine_\w+_names)\}", lambda m: values[m.group(1)], text)


def split_statements(text: str) -> list[str]:
    """Statements of a .sql file, split at `;` line ends; comment-only chunks dropped."""
    out = []
    for chunk in re.split(r";[ \t]*(?:\n|$)", text):
        code = "\n".join(line for line in chunk.splitlines() if not line.lstrip().startswith("--"))
        if code.strip():
            out.append(chunk.strip())
    return out


def _use_a_reusing_pool() -> None:
    """Make pyarrow allocate from jemalloc's pool where it has it, else the system allocator, in every
    process that writes to a store. Not pyarrow's default mimalloc: an insert's Arrow file and tables are
    tens of MB, and mimalloc handed those pages back to the kernel and faulted them in again on every
    insert (the ingest benchmark's rows inserted alone in 50,000-row blocks: 22 us a row, 15 of them in
    the kernel; 12-14 with jemalloc's pool; in 20,000-row blocks 17 against 14)."""
    try:
        pool = pa.jemalloc_memory_pool()
    except (NotImplementedError, pa.ArrowNotImplementedError):
        pool = pa.system_memory_pool()
    pa.set_memory_pool(pool)


_use_a_reusing_pool()


ARROW_CHUNK_ROWS = 8192


def _arrow_stream(table: pa.Table) -> Iterator[bytes]:
    """An Arrow table as the bytes of an Arrow IPC stream, a record batch of ARROW_CHUNK_ROWS rows at a time:
    chDB's client writes each piece to its insert file as it comes, so no copy of the whole table is
    held beside the table itself (a 50,000-row group of spans is about 65 MB)."""
    pieces: list[bytes] = []
    sink = pa.PythonFile(_Pieces(pieces), mode="w")
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=ARROW_CHUNK_ROWS):
            writer.write_batch(batch)
            yield from pieces
            pieces.clear()
    yield from pieces


class _Pieces:
    """A write-only file that keeps what is written to it as a list of bytes."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        self.pieces.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _connect(target: Target) -> Any:
    settings = {"session_timezone": "UTC"}
    if target.kind == "chdb":
        dsn = "chdb://memory" if target.path == ":memory:" else f"chdb://{target.path}"
        try:
            return clickhouse_connect.get_client(dsn=dsn, settings=settings)
        except Exception as e:
            raise StoreError(f"cannot open {target.description}: {_first_line(e)}") from e
    args = dict(target.connect_args)
    try:
        client = clickhouse_connect.get_client(
            **args,
            connect_timeout=3,
            send_receive_timeout=60,
            settings=settings,
            autogenerate_session_id=False,
        )
        if target.database != "default":
            client.command(f"CREATE DATABASE IF NOT EXISTS `{target.database}`")
            client.database = target.database
        return client
    except OperationalError as e:
        raise StoreUnavailable(f"store {target.description} unreachable: {_first_line(e)}") from e
    except ClickHouseError as e:
        raise StoreError(f"cannot open {target.description}: {_first_line(e)}") from e


def _run(
    client: Any, sql: str, parameters: dict[str, Any] | None, max_rows: int | None = None
) -> QueryResult:
    try:
        result = client.query(sql, parameters=parameters)
    except OperationalError as e:
        raise StoreUnavailable(f"store unreachable: {_first_line(e)}") from e
    except ClickHouseError as e:  # syntax, unknown table, readonly, limits: the query's fault
        raise QueryError(_first_line(e)) from None
    rows = [list(r) for r in result.result_rows]
    truncated = max_rows is not None and len(rows) > max_rows
    return QueryResult(list(result.column_names), rows[:max_rows] if truncated else rows, truncated)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    m = re.search(r"(Code: \d+\. DB::Exception: .*?)(?: \(version [\d.]+\)|$)", text, re.S)
    text = m.group(1) if m else text
    return " ".join(text.split())[:500]
