from __future__ import annotations

import pytest

from lifecycle import Lifecycle
from tests.lifecycle.probes import make_lifecycle


@pytest.fixture
def lc() -> Lifecycle:
    return make_lifecycle()
