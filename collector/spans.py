"""ExportTraceServiceRequest bytes -> otel_traces rows through the compiled decoder (collector/spans.c).

The decoder walks the protobuf wire format once and writes every column into flat buffers (strings as
bytes plus offsets, maps as entry offsets plus keys and values); Arrow takes those buffers as they are, so
no Python object is made per span or per attribute. ctypes releases the GIL for each call, so a request
thread decoding runs beside the insert thread and the HTTP loop.

    decoder = SpanDecoder()                  # None from decoder() where no C compiler is found
    rejected = decoder.feed(payload)         # PayloadError (buffers unchanged) if it does not parse
    table = decoder.table()                  # one Arrow table for every payload fed

The library is compiled on first use with the system C compiler, once per source, flags and compiler,
into `$STEPSCOPE_KERNEL_DIR` (default `~/.cache/stepscope/kernels`) by an atomic rename. Without a
compiler `available()` is False and collector/traces.py converts in Python, to the same rows.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import pyarrow as pa

from collector.otlp import PayloadError
from collector.traces import _KIND_NAMES, _NS, _STATUS_NAMES, _STR, SCHEMA, _dictionary, _list_array
from stepscope.native import build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("spans.c")
FLAGS = ["-O3", "-fPIC", "-shared", "-fno-strict-aliasing"]
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # [] until the first try, then [library or None]


def available() -> bool:
    """Whether the compiled decoder can be used here (builds it on the first call)."""
    return _load() is not None


def _load() -> ctypes.CDLL | None:
    with _lock:
        if not _library:
            try:
                lib = ctypes.CDLL(str(_build()))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.warning("compiled span decoder unavailable (%s); converting spans in Python", e)
                lib = None
            else:
                lib.ss_new.restype = ctypes.c_void_p
                lib.ss_free.argtypes = [ctypes.c_void_p]
                lib.ss_reset.argtypes = [ctypes.c_void_p]
                lib.ss_feed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
                lib.ss_feed.restype = ctypes.c_int
                lib.ss_check.argtypes = [*lib.ss_feed.argtypes, ctypes.c_void_p, ctypes.c_void_p]
                lib.ss_check.restype = ctypes.c_int
                lib.ss_buffer_names.restype = ctypes.c_char_p
                lib.ss_detach.argtypes = [ctypes.c_void_p, ctypes.c_int]
                lib.ss_detach.restype = ctypes.c_void_p
                lib.ss_resource_rows.argtypes = [ctypes.c_void_p]
            _library.append(lib)
        return _library[0]


def _build() -> Path:
    return build_library("stepscope-spans", [SOURCE], FLAGS, BUILD_TIMEOUT_S)


class _Buffer(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("len", ctypes.c_int64), ("cap", ctypes.c_int64)]


def _decoder_struct(names: list[str]) -> type[ctypes.Structure]:
    class Decoder(ctypes.Structure):
        _fields_ = [
            ("b", _Buffer * len(names)),
            ("rows", ctypes.c_int64),
            ("rejected", ctypes.c_int64),
            ("resources", ctypes.c_int64),
            ("scopes", ctypes.c_int64),
            ("check_only", ctypes.c_int64),
            ("error", ctypes.c_char * 256),
        ]

    return Decoder


class SpanDecoder:
    """Rows of one or more export requests, accumulated in C buffers until `table()`."""

    def __init__(self) -> None:
        lib = _load()
        if lib is None:
            raise RuntimeError("the compiled span decoder is not available")
        self._lib = lib
        self._names = lib.ss_buffer_names().decode().split(",")
        self._index = {name: i for i, name in enumerate(self._names)}
        self._ptr = lib.ss_new()
        if not self._ptr:
            raise MemoryError("cannot allocate a span decoder")
        self._state = _decoder_struct(self._names).from_address(self._ptr)

    def close(self) -> None:
        if self._ptr:
            self._lib.ss_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> SpanDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rows(self) -> int:
        return self._state.rows

    @property
    def rejected(self) -> int:
        """Spans left out so far for want of a valid 16-byte trace id and 8-byte span id."""
        return self._state.rejected

    def feed(self, payload: bytes) -> int:
        """Append the rows of one ExportTraceServiceRequest's bytes; how many spans it had rejected.
        PayloadError (and nothing appended) if the bytes are not a valid request."""
        before = self._state.rejected
        self._raise_unless(self._lib.ss_feed(self._ptr, bytes(payload), len(payload)) == 0)
        return self._state.rejected - before

    def check(self, payload: bytes) -> tuple[int, int]:
        """What `feed` would keep and reject of one request, without keeping anything: (rows, rejected).
        PayloadError for what `feed` refuses."""
        rows, rejected = ctypes.c_int64(), ctypes.c_int64()
        status = self._lib.ss_check(
            self._ptr, bytes(payload), len(payload), ctypes.byref(rows), ctypes.byref(rejected)
        )
        self._raise_unless(status == 0)
        return rows.value, rejected.value

    def _raise_unless(self, ok: bool) -> None:
        if ok:
            return
        detail = self._state.error.decode(errors="replace")
        if "2262" in detail:
            raise PayloadError(detail)
        raise PayloadError(f"malformed protobuf ExportTraceServiceRequest: {detail}")

    def reset(self) -> None:
        """Forget every row fed so far (the buffers are kept for reuse)."""
        self._lib.ss_reset(self._ptr)

    def table(self) -> pa.Table:
        """Every row fed so far as one otel_traces Arrow table; the decoder starts empty again. The table
        owns the decoder's buffers (no copy), freed with it."""
        if self._lib.ss_resource_rows(self._ptr) != 0:
            raise MemoryError(self._state.error.decode(errors="replace"))
        st = self._state
        rows, scopes, resources = st.rows, st.scopes, st.resources
        events, links = self._count("ev_off", rows), self._count("ln_off", rows)
        b = {name: self._take(name) for name in self._names}
        self.reset()

        def ints(name: str, n: int, kind: pa.DataType = pa.int32()) -> pa.Array:
            return pa.Array.from_buffers(kind, n, [None, b[name]])

        def strings(name: str, n: int) -> pa.Array:
            return pa.Array.from_buffers(_STR, n, [None, b[f"{name}_off"], b[name]])

        def maps(name: str, n: int) -> pa.MapArray:
            offsets = ints(f"{name}_off", n + 1)
            entries = offsets[n].as_py()
            keys, values = strings(f"{name}_k", entries), strings(f"{name}_v", entries)
            return pa.MapArray.from_arrays(offsets, keys, values)

        scope_of_row, scope_resource = ints("scope", rows), ints("sc_res", scopes)
        ev_off, ln_off = ints("ev_off", rows + 1), ints("ln_off", rows + 1)
        columns = [
            ints("ts", rows, _NS),
            strings("tid", rows),
            strings("sid", rows),
            strings("psid", rows),
            strings("tstate", rows),
            strings("name", rows),
            _dictionary(ints("kind", rows), _KIND_NAMES),
            _dictionary(scope_of_row, strings("rservice", resources).take(scope_resource)),
            maps("rr", rows),
            _dictionary(scope_of_row, strings("sc_name", scopes)),
            _dictionary(scope_of_row, strings("sc_version", scopes)),
            maps("sa", rows),
            ints("dur", rows, pa.uint64()),
            _dictionary(ints("code", rows), _STATUS_NAMES),
            strings("smsg", rows),
            _list_array(ev_off, ints("ev_ts", events, _NS)),
            _list_array(ev_off, strings("ev_name", events)),
            _list_array(ev_off, maps("ea", events)),
            _list_array(ln_off, strings("ln_tid", links)),
            _list_array(ln_off, strings("ln_sid", links)),
            _list_array(ln_off, strings("ln_state", links)),
            _list_array(ln_off, maps("la", links)),
        ]
        return pa.Table.from_arrays(columns, schema=SCHEMA)

    def _take(self, name: str) -> pa.Buffer:
        """Buffer `name` detached from the decoder, as an Arrow buffer that frees it when released."""
        i = self._index[name]
        size = self._state.b[i].len
        address = self._lib.ss_detach(self._ptr, i)
        if not address:
            return pa.py_buffer(b"")
        return pa.foreign_buffer(address, size, base=_Malloced(address))

    def _count(self, name: str, rows: int) -> int:
        """The last of `rows + 1` int32 offsets: how many elements the rows hold."""
        raw = self._state.b[self._index[name]]
        return ctypes.c_int32.from_address(raw.p + 4 * rows).value


class _Malloced:
    """The owner of a buffer the decoder malloc'ed: frees it when Arrow lets go of it."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address

    def __del__(self) -> None:
        _free(self.address)


_free = ctypes.CDLL(None).free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None


def decoder() -> SpanDecoder | None:
    """A fresh decoder, or None where the compiled one cannot be built."""
    return SpanDecoder() if available() else None
