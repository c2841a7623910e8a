"""The `rig` fixture: a fresh in-process tracing rig per test (tests/instrumentation/span_rig.py)."""

import pytest
from span_rig import Rig, make_rig


@pytest.fixture
def rig() -> Rig:
    return make_rig()
