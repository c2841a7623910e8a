"""The `stepscope` command: one subcommand per capability.

Each subcommand lives beside the code it drives, as a module exposing
`add_arguments(parser)` and `run(args) -> int`. The table below is the only place
that knows them all; modules are imported lazily so `stepscope --help` stays fast
and a broken optional part never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("stepscope.demo", "watch stepscope find a root cause, everything local"),
    "serve": ("engine.serve_cli", "serve a model with an OpenAI-compatible HTTP API"),
    "collector": ("collector.cli", "receive OTLP spans and metrics into ClickHouse"),
    "bench": ("loadgen.cli", "load-test an OpenAI-compatible server and find its capacity knee"),
    "diagnose": ("diagnosis.cli", "why did TTFT/TPOT regress: ranked causes with evidence and levers"),
    "query": ("diagnosis.query_cli", "named post-incident queries (slowest, compare, waterfall, ...)"),
    "alerts": ("alerting.cli", "SLO and P99 alert rules: check, list, history, run"),
    "dashboard": ("dashboard.cli", "Streamlit dashboard over the collector's query API"),
    "scenario": ("scenarios.cli", "run a fault scenario: engine, collector, load, truth.json"),
    "eval": ("scenarios.eval", "run every fault scenario, diagnose each, print the scoreboard"),
}


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="stepscope", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UsageError as e:
        print(f"stepscope {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
