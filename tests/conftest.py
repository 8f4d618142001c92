"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """Where the third-party data lives: $CDGPC_DATA_DIR, else ../shared/data beside the clone."""
    return Path(os.environ.get("CDGPC_DATA_DIR", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """The third-party traces and measurements; tests that need them skip (locally) without them.

    Under CI=true the data must be there: a missing directory fails instead of skipping.
    """
    path = shared_data_dir()
    if not path.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the shared data directory {path} is missing")
        pytest.skip(f"third-party data not found at {path} (set CDGPC_DATA_DIR)")
    return path
