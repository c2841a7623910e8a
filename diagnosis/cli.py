"""`stepscope diagnose`: why did TTFT/TPOT regress? Reads a store (`--store DSN`) or a running collector
(`--api URL`), compares the window with a baseline (given, or the window's own change point), and prints
findings as text, Markdown or JSON (docs/diagnosis.md).

Bad input (an unparsable time, both or neither of --store/--api, an unreachable API) raises UsageError:
one line, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from collector.client import Reader, ReadError, open_reader
from collector.timerange import TimeRange, parse_time
from diagnosis.fleet import scoped
from diagnosis.pipeline import diagnose
from diagnosis.render import FORMATS, render
from stepscope.cli import UsageError

TIME_HELP = "ISO 8601, unix seconds, or an ago-duration like 15m, 2h, 90s"


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """--store / --api / --token, shared with `stepscope query`."""
    parser.add_argument("--store", help="store DSN: chdb:///dir or http://user:pass@host:8123/db")
    parser.add_argument("--api", help="a running collector's URL, e.g. http://127.0.0.1:4318")
    parser.add_argument("--token", default=os.environ.get("STEPSCOPE_TOKEN"), help="the collector's token")
    parser.add_argument(
        "--service", action="append", metavar="NAME", help="only these services (repeat or comma-separate)"
    )
    parser.add_argument(
        "--instance", action="append", metavar="ID",
        help="only these instances (service.instance.id; repeat or comma-separate)",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `stepscope diagnose`."""
    add_source_arguments(parser)
    parser.add_argument("--from", dest="time_from", help=f"window start ({TIME_HELP}); default: everything")
    parser.add_argument("--to", dest="time_to", help="window end (default: now, or everything)")
    parser.add_argument("--baseline-from", help="baseline start (default: the window's change point)")
    parser.add_argument("--baseline-to", help="baseline end")
    parser.add_argument("--format", choices=FORMATS, default="text")


def _time(text: str, what: str, now: float) -> float:
    try:
        return parse_time(text, now)
    except ValueError as e:
        raise UsageError(f"{what}: {e}") from None


def _range(start: str | None, end: str | None, what: str, now: float) -> TimeRange | None:
    if start is None and end is None:
        return None
    t0 = _time(start, f"--{what}from", now) if start is not None else 0.0
    t1 = _time(end, f"--{what}to", now) if end is not None else now + 1.0
    try:
        return TimeRange(t0, t1)
    except ValueError as e:
        raise UsageError(f"--{what}from/--{what}to: {e}") from None


def open_from_args(args: argparse.Namespace) -> Reader:
    """The Reader named by --store/--api, or UsageError."""
    if bool(args.store) == bool(args.api):
        raise UsageError("give exactly one of --store DSN or --api URL")
    path = args.store[len("chdb://") :] if args.store and args.store.startswith("chdb://") else None
    if path and path not in ("memory", ":memory:") and not os.path.isdir(os.path.expanduser(path)):
        raise UsageError(f"no store at {args.store}")
    try:
        source = open_reader(store=args.store, url=args.api, token=args.token)
    except (ValueError, ReadError) as e:
        raise UsageError(str(e)) from None
    return scoped(source, _names(getattr(args, "service", None)), _names(getattr(args, "instance", None)))


def _names(given: list[str] | None) -> list[str]:
    return [n.strip() for item in given or [] for n in item.split(",") if n.strip()]


def run(args: argparse.Namespace) -> int:
    """Diagnose and print; exit 0 (findings or not)."""
    now = time.time()
    window = _range(args.time_from, args.time_to, "", now)
    baseline = _range(args.baseline_from, args.baseline_to, "baseline-", now)
    if (args.baseline_from is None) != (args.baseline_to is None):
        raise UsageError("give both --baseline-from and --baseline-to, or neither")
    source = open_from_args(args)
    try:
        result = diagnose(source, window=window, baseline=baseline)
    except ReadError as e:
        raise UsageError(str(e)) from None
    finally:
        source.close()
    sys.stdout.write(render(result, args.format))
    if args.format == "json":
        sys.stdout.write("\n")
    return 0
