"""The markers that say what a test needs, checked where the need arises.

``make test-quick`` runs the tests that carry none of ``distributed``,
``deepspeed``, ``s3``, ``browser`` and ``slow``. A marker is only useful if it
is true, so the code that starts ranks, DeepSpeed, the S3 server or Chromium
calls ``require`` first: a test that reaches it without the marker fails and
says which marker to add. ``tests/conftest.py`` sets the running test.
"""

from __future__ import annotations

import pytest

#: Each marker and what it stands for (pyproject.toml registers the same list).
MARKERS = {
    "distributed": "starts torch.distributed ranks (spawned, or under torchrun)",
    "deepspeed": "runs the real DeepSpeed",
    "s3": "talks to the moto S3 server",
    "browser": "renders a page in headless Chromium",
    "slow": "takes more than a few seconds on its own",
}

_current: pytest.Item | None = None


def set_current(item: pytest.Item | None) -> None:
    global _current
    _current = item


def require(marker: str) -> None:
    """Fail the running test unless it is marked ``marker`` (outside a test, do nothing)."""
    item = _current
    if item is not None and item.get_closest_marker(marker) is None:
        pytest.fail(f"{item.nodeid} {MARKERS[marker]}: mark it @pytest.mark.{marker}", pytrace=False)
