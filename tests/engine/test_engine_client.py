"""Both engine clients the OpenAI front end can sit on offer every call of `EngineClient`."""

from __future__ import annotations

import inspect

import pytest

from engine.core_client import AsyncEngineClient
from engine.disagg.router import DisaggClient
from engine.engine_client import EngineClient

_CALLS = sorted(n for n, v in vars(EngineClient).items() if not n.startswith("_") and inspect.isfunction(v))


@pytest.mark.parametrize("client", [AsyncEngineClient, DisaggClient], ids=lambda c: c.__name__)
def test_every_engine_client_call_is_implemented_with_the_same_parameters(client: type) -> None:
    assert {"add", "abort", "admin", "health_report", "extra_metrics"} <= set(_CALLS)
    for name in _CALLS:
        implemented, declared = getattr(client, name), getattr(EngineClient, name)
        assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters)
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), name
