"""Ports and waiting."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from stepscope.procs import free_port

__all__ = ["free_port", "wait_for"]


def wait_for(
    check: Callable[[], object], timeout_s: float = 60.0, why: Callable[[], str] = lambda: ""
) -> None:
    """Poll `check` until it is true; fail the test, saying `why()`, when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached in {timeout_s:g} s {why()}".rstrip())
        time.sleep(0.05)
