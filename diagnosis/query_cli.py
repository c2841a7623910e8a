"""`stepscope query NAME [key=value ...]`: the named post-incident queries (diagnosis/library.py), against a
store (`--store`) or a running collector (`--api`). `stepscope query --list` lists them and their
parameters. An unknown name, a missing or bad parameter, or an unreachable source: UsageError (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from collector.client import ReadError
from diagnosis import library
from diagnosis.cli import add_source_arguments, open_from_args
from stepscope.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `stepscope query`."""
    parser.add_argument("name", nargs="?", help="a query of the library (see --list)")
    parser.add_argument("params", nargs="*", metavar="key=value", help="the query's parameters")
    parser.add_argument("--list", action="store_true", help="list the queries and their parameters")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    add_source_arguments(parser)


def listing() -> str:
    """Every query with its parameters and defaults."""
    lines = []
    for q in library.LIBRARY.values():
        lines.append(f"{q.name}: {q.description}")
        for name, p in q.params.items():
            default = "required" if p.default is None else f"default {p.default or 'now'!r}"
            choices = f" one of {', '.join(p.choices)};" if p.choices else ""
            lines.append(f"    {name}=  {p.help};{choices} {default}")
    return "\n".join(lines) + "\n"


def _values(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"parameters are key=value, got {pair!r}")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    """Print the listing, or run one query and print its rows."""
    if args.list:
        sys.stdout.write(listing())
        return 0
    if not args.name:
        raise UsageError("name a query (stepscope query --list shows them)")
    if args.name not in library.LIBRARY:
        raise UsageError(f"unknown query {args.name!r}: choose from {', '.join(library.LIBRARY)}")
    query = library.LIBRARY[args.name]
    try:
        params = library.bind(query, _values(args.params), time.time())
    except ValueError as e:
        raise UsageError(str(e)) from None
    source = open_from_args(args)
    try:
        result = source.query(query.sql, params)
    except ReadError as e:
        raise UsageError(str(e)) from None
    finally:
        source.close()
    if args.format == "json":
        sys.stdout.write(json.dumps({"columns": result.columns, "rows": result.rows}, default=str) + "\n")
    elif query.view == "waterfall":
        sys.stdout.write(library.waterfall(result))
    else:
        sys.stdout.write(library.table(result))
    return 0
