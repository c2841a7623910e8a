"""An on-disk spool of export requests: the write-ahead log between acknowledgement and the store.

One file per batch, named `<arrival ns>-<signal>-<token>.otlp`, holding the request's protobuf bytes. A file
is written under a temporary name, fsynced, renamed into place and the directory fsynced, so after `put()`
returns the batch survives `kill -9` and power loss; a temporary file left by a crash was never
acknowledged and is removed on open. The spool is bounded in bytes: `put()` past the bound raises
`SpoolFull`.

Batches are inserted in groups. Before a group's insert, a manifest (`groups/<token>.json`: the group's
de-duplication token and its entries) is fsynced; after the insert, the entries and then the manifest are
removed. A crash anywhere in between leaves the manifest, and the group is replayed exactly as it was, with
the same token, so ClickHouse drops whatever part of it had already gone in.

The spool lists its directory once, on open, and then keeps the list itself: the insert thread asks for
the pending batches each time a batch arrives, and listing and stat-ing a few hundred files each time cost
more CPU than writing them. A file moved into the directory by hand is seen at the next open.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"(\d{20})-(traces|metrics|logs)-([0-9a-f]{16,64})\.otlp")


class SpoolFull(Exception):
    """The spool is at its byte bound: answer 503 with Retry-After."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One spooled batch."""

    path: Path
    signal: str
    token: str
    size: int


class Spool:
    """A bounded directory of fsynced batches, oldest first. Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = Path(directory)
        self.failed_directory = self.directory / "failed"
        self.groups_directory = self.directory / "groups"
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bytes = 0
        self._count = 0
        self._entries: dict[str, Entry] = {}  # file name -> entry, of the batches written and not removed

    def open(self) -> Spool:
        """Create the directory, drop unacknowledged temporary files, count what is pending."""
        self.groups_directory.mkdir(parents=True, exist_ok=True)
        for tmp in [*self.directory.glob(".tmp-*"), *self.groups_directory.glob(".tmp-*")]:
            tmp.unlink(missing_ok=True)
        entries = self._listed()
        with self._lock:
            self._entries = {e.path.name: e for e in entries}
            self._count = len(entries)
            self._bytes = sum(e.size for e in entries)
        return self

    @property
    def count(self) -> int:
        return self._count

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def failed_count(self) -> int:
        """Batches set aside after repeated store errors (kept, never deleted, for an operator)."""
        return len(list(self.failed_directory.glob("*.otlp"))) if self.failed_directory.exists() else 0

    def put(self, signal: str, token: str, payload: bytes, arrival_ns: int) -> Entry:
        """Write one batch durably. Returns once the file and its directory entry are on disk."""
        with self._lock:
            if self._bytes + len(payload) > self.max_bytes:
                raise SpoolFull(f"spool {self.directory} is full ({self._bytes} of {self.max_bytes} bytes)")
            self._bytes += len(payload)
            self._count += 1
        name = self.name_of(signal, token, arrival_ns)
        final = self.directory / name
        tmp = self.directory / f".tmp-{name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            self._fsync_dir()
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._bytes -= len(payload)
                self._count -= 1
            raise
        entry = Entry(final, signal, token, len(payload))
        with self._lock:
            self._entries[name] = entry
        return entry

    @staticmethod
    def name_of(signal: str, token: str, arrival_ns: int) -> str:
        """The file name `put` gives a batch."""
        return f"{arrival_ns:020d}-{signal}-{token}.otlp"

    def pending(self) -> list[Entry]:
        """Spooled batches, oldest first."""
        with self._lock:
            entries = list(self._entries.values())
        entries.sort(key=lambda e: e.path.name)
        return entries

    def _listed(self) -> list[Entry]:
        """The batches in the directory, oldest first."""
        out = []
        for path in sorted(self.directory.glob("*.otlp")):
            m = _NAME.fullmatch(path.name)
            if m:
                try:
                    out.append(Entry(path, m.group(2), m.group(3), path.stat().st_size))
                except FileNotFoundError:
                    continue
        return out

    def read(self, entry: Entry) -> bytes:
        return entry.path.read_bytes()

    def remove(self, entry: Entry) -> None:
        """Forget a batch once the store has it."""
        with contextlib.suppress(FileNotFoundError):  # removed by hand: forget it all the same
            entry.path.unlink()
        self._forget(entry)

    def set_aside(self, entry: Entry) -> Path:
        """Move a batch the store keeps refusing to `failed/`, out of the drain loop but still on disk."""
        self.failed_directory.mkdir(exist_ok=True)
        target = self.failed_directory / entry.path.name
        with contextlib.suppress(FileNotFoundError):  # removed by hand: nothing to keep
            os.replace(entry.path, target)
        self._forget(entry)
        return target

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            if self._entries.pop(entry.path.name, None) is not None:
                self._bytes -= entry.size
                self._count -= 1

    # --- groups ---------------------------------------------------------------------------------------
    def write_group(self, token: str, entries: list[Entry]) -> Path:
        """Durably record that `entries` go into the store together under `token`."""
        path = self.groups_directory / f"{token}.json"
        tmp = self.groups_directory / f".tmp-{token}.json"
        text = json.dumps({"token": token, "entries": [e.path.name for e in entries]})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir(self.groups_directory)
        return path

    def groups(self) -> list[tuple[Path, str, list[Entry]]]:
        """Recorded groups not yet finished: (manifest, token, entries still present)."""
        out = []
        for path in sorted(self.groups_directory.glob("*.json")):
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)  # written under a temporary name, so never half-written
                continue
            entries = []
            for name in manifest["entries"]:
                m = _NAME.fullmatch(name)
                entry_path = self.directory / name
                if m and entry_path.exists():
                    entries.append(Entry(entry_path, m.group(2), m.group(3), entry_path.stat().st_size))
            out.append((path, manifest["token"], entries))
        return out

    def finish_group(self, manifest: Path, entries: list[Entry]) -> None:
        """The group is in the store: remove its entries, make that durable, then remove the manifest."""
        for entry in entries:
            self.remove(entry)
        self._fsync_dir()
        manifest.unlink(missing_ok=True)

    def drop_group(self, manifest: Path) -> None:
        """Forget a grouping (its entries stay spooled and are grouped again later)."""
        manifest.unlink(missing_ok=True)

    def _fsync_dir(self, directory: Path | None = None) -> None:
        fd = os.open(directory or self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
