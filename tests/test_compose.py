"""docker-compose.yml is right by construction: Docker cannot run here, so the file is validated against the
compose-spec JSON schema and every reference in it is checked against the code it starts.

- each service's `stepscope SUBCOMMAND --options` parses with that subcommand's real argparse parser (built
  from stepscope/cli.py's table) and passes the subcommand's own validation (the config dataclasses);
- the ports a service publishes, its healthcheck and the URLs other services use agree with the port its
  command listens on, and every listener binds 0.0.0.0;
- every `${VAR}` has a default, and one default everywhere it appears;
- every `depends_on` target exists, is not in a profile the dependent lacks, and has a healthcheck when the
  condition is `service_healthy`;
- named volumes are declared, bind-mounted files exist, the alert rules file loads;
- disaggregated workers join a router's worker port, and decode workers advertise a KV address that the
  other containers can reach;
- the Dockerfile copies every package pyproject.toml installs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from stepscope.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"  # the compose-spec schema (see tests/data/README.md)
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")
URL = re.compile(r"https?://(?:[^@/\s]+@)?([a-z][a-z0-9_-]*):(\d+)")
IMAGE_PORTS = {"clickhouse": {8123}}  # services not started by a stepscope command: what the image listens on


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with an empty environment (the defaults a fresh checkout runs with)."""
    return VAR.sub(lambda m: m.group(3) or "", value).replace("$$", "$")


def deep(value: Any) -> Any:
    if isinstance(value, str):
        return interpolate(value)
    if isinstance(value, list):
        return [deep(v) for v in value]
    if isinstance(value, dict):
        return {k: deep(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return deep(raw["services"])


def stepscope_command(svc: dict[str, Any]) -> list[str] | None:
    command = svc.get("command")
    if isinstance(command, list) and command and command[0] == "stepscope":
        return [str(c) for c in command[1:]]
    assert not isinstance(command, str), "commands are lists: a string would be split by a shell"
    return None


def parse(sub: str, argv: list[str]) -> argparse.Namespace:
    """`stepscope SUB ARGV...` through the subcommand's own parser; AssertionError with argparse's message."""
    assert sub in SUBCOMMANDS, f"stepscope has no subcommand {sub!r}"
    module = importlib.import_module(SUBCOMMANDS[sub][0])
    parser = argparse.ArgumentParser(prog=f"stepscope {sub}")
    module.add_arguments(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1:]
        raise AssertionError(f"stepscope {sub} {' '.join(argv)}: {message}") from None


def validate(sub: str, args: argparse.Namespace) -> None:
    """The subcommand's own checks beyond argparse (DSN, model preset, durations, loads)."""
    if sub == "serve":
        from engine.serve_cli import engine_config

        engine_config(args)
    elif sub == "collector":
        from collector.config import CollectorConfig

        CollectorConfig(**{f: getattr(args, f) for f in CollectorConfig.__dataclass_fields__})
    elif sub == "dashboard":
        from dashboard.cli import config_from_args

        config_from_args(args)
    elif sub == "bench":
        from loadgen.cli import build_config

        build_config(args)


def option(svc: dict[str, Any], flag: str) -> str | None:
    argv = stepscope_command(svc) or []
    return argv[argv.index(flag) + 1] if flag in argv else None


def listen_port(name: str, svc: dict[str, Any]) -> int | None:
    port = option(svc, "--port")
    return None if port is None else int(port)


def ports_of(services: dict[str, dict[str, Any]]) -> dict[str, set[int]]:
    """What each service listens on: --port, a router's --worker-port, or the image's port."""
    out = {name: set(IMAGE_PORTS.get(name, set())) for name in services}
    for name, svc in services.items():
        for flag in ("--port", "--worker-port"):
            if option(svc, flag) is not None:
                out[name].add(int(option(svc, flag)))
    return out


def test_the_file_validates_against_the_compose_spec_schema(raw: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(raw)  # its $schema: draft 7


def test_the_stack_has_clickhouse_collector_engine_dashboard_and_the_two_profiles(services) -> None:
    assert services["clickhouse"]["image"].startswith("clickhouse/clickhouse-server:")
    subs = {name: (stepscope_command(svc) or [None])[0] for name, svc in services.items()}
    assert subs["collector"] == "collector" and subs["engine"] == "serve" and subs["dashboard"] == "dashboard"
    assert subs["load"] == "bench" and services["load"]["profiles"] == ["load"]
    store = stepscope_command(services["collector"])
    assert store[store.index("--store") + 1].startswith("http://default:")
    assert "@clickhouse:8123/" in store[store.index("--store") + 1]
    for name, svc in services.items():
        if "disagg" in svc.get("profiles", []):
            assert subs[name] == "serve", f"{name}: the disagg profile runs stepscope serve"


def test_every_command_parses_with_its_subcommands_parser_and_validates(services) -> None:
    checked = 0
    for name, svc in services.items():
        argv = stepscope_command(svc)
        if argv is None:
            continue
        sub, rest = argv[0], argv[1:]
        args = parse(sub, rest)
        try:
            validate(sub, args)
        except Exception as e:
            raise AssertionError(f"service {name}: stepscope {sub}: {e}") from e
        checked += 1
    assert checked >= 4


def test_listeners_bind_all_interfaces_and_ports_agree(services) -> None:
    ports = ports_of(services)
    for name, svc in services.items():
        argv = stepscope_command(svc)
        port = listen_port(name, svc)
        if port is not None:
            assert argv[argv.index("--host") + 1] == "0.0.0.0", f"{name} listens on loopback only"
        for mapping in svc.get("ports", []):
            container = int(str(mapping).rsplit(":", 1)[-1].split("/")[0])
            assert container in ports[name], f"{name} publishes {container}, listens on {ports[name]}"
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        for _host, hport in re.findall(r"https?://(127\.0\.0\.1|localhost):(\d+)", test):
            assert int(hport) in ports[name], f"{name}: healthcheck probes {hport}, listens on {ports[name]}"


def test_urls_between_services_name_a_service_and_its_port(services) -> None:
    ports = ports_of(services)
    seen = 0
    for name, svc in services.items():
        text = json.dumps([svc.get("command"), svc.get("environment")])
        for host, port in URL.findall(text):
            if host in ("localhost",):
                continue
            assert host in services, f"{name} refers to {host}:{port}, which is no service"
            assert int(port) in ports[host], f"{name} uses {host}:{port}; {host} listens on {ports[host]}"
            seen += 1
    assert seen >= 4


def test_every_variable_has_one_default(raw: dict[str, Any]) -> None:
    text = COMPOSE.read_text()
    defaults: dict[str, set[str]] = {}
    for var, op, default in VAR.findall(text):
        assert op == ":-", f"${{{var}}} has no default (use ${{{var}:-...}})"
        defaults.setdefault(var, set()).add(default)
    assert defaults, "ports and tokens come from variables"
    for var, values in defaults.items():
        assert len(values) == 1, f"{var} has different defaults: {sorted(values)}"
    wanted = ("STEPSCOPE_TOKEN", "CLICKHOUSE_PASSWORD", "STEPSCOPE_ENGINE_PORT", "STEPSCOPE_COLLECTOR_PORT")
    for var in wanted:
        assert var in defaults, f"{var} is not configurable"


def test_the_collector_token_is_what_the_exporters_and_dashboard_send(services) -> None:
    token = services["collector"]["environment"]["STEPSCOPE_TOKEN"]
    assert token
    assert services["dashboard"]["environment"]["STEPSCOPE_TOKEN"] == token
    for name, svc in services.items():
        argv = stepscope_command(svc) or []
        if "--otlp-endpoint" in argv:
            headers = svc["environment"]["OTEL_EXPORTER_OTLP_HEADERS"]
            assert headers == f"Authorization=Bearer%20{token}", name


def test_depends_on_targets_exist_and_have_healthchecks(services) -> None:
    for name, svc in services.items():
        for target, cond in (svc.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            target_profiles = set(services[target].get("profiles", []))
            assert not target_profiles or target_profiles & set(svc.get("profiles", [])), (
                f"{name} depends on {target}, which only runs in profiles {target_profiles}"
            )
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}: no healthcheck"


def test_volumes_are_declared_and_mounted_files_exist(raw: dict[str, Any], services) -> None:
    declared = set(raw.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"


def test_the_mounted_alert_rules_load() -> None:
    from alerting.rules import load_rules

    assert load_rules(ROOT / "deploy" / "alerts.toml").rules


def test_the_dockerfile_copies_every_installed_package() -> None:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile, re.M))
    for pattern in include["include"]:
        package = pattern.rstrip("*")
        assert package in copied, f"the Dockerfile does not copy {package}/"
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+/cpu$", dockerfile, re.M), "the CPU torch build is the default"


def test_disaggregated_workers_join_the_router_and_advertise_reachable_kv_addresses(services) -> None:
    disagg = {n: svc for n, svc in services.items() if "disagg" in svc.get("profiles", [])}
    routers = {n for n, svc in disagg.items() if "--disagg" in stepscope_command(svc)}
    workers = {n: option(svc, "--role") for n, svc in disagg.items() if option(svc, "--role")}
    assert routers and sorted(workers.values()) == ["decode", "prefill"], disagg
    models = {option(svc, "--model") for svc in disagg.values()}
    assert len(models) == 1, f"router and workers serve different models: {models}"
    for name in workers:
        host, _, port = option(disagg[name], "--router").rpartition(":")
        assert host in routers, f"{name} joins {host}, which is not a router"
        assert option(disagg[host], "--worker-port") == port, (
            f"{name} joins {host}:{port}: not its worker port"
        )
        assert host in disagg[name]["depends_on"], f"{name} starts before its router"
    for name, svc in disagg.items():  # whoever runs a decode worker binds its KV port on its own name
        if workers.get(name) == "decode" or name in routers:
            assert option(svc, "--kv-host") == svc.get("hostname") == name, name
