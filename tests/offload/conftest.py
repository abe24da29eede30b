"""Fixtures of the offload tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def tiers():
    """Disk tiers made by a test, closed even when it fails (their I/O threads stop)."""
    made = []
    yield made
    for tier in made:
        tier.close()
