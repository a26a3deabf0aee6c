"""The test markers: one list, registered with pytest, and checked where a test's need arises."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.support.markers import MARKERS

ROOT = Path(__file__).resolve().parents[2]


def test_the_markers_are_the_ones_pytest_knows():
    registered = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = {line.split(":", 1)[0] for line in registered}
    assert names == {*MARKERS, "exhaustive"}


@pytest.mark.exhaustive
def test_a_test_that_starts_ranks_without_its_marker_fails_and_says_which(tmp_path):
    """Negative control of the check: an unmarked test reaching run_ranks fails before any rank starts
    (a whole pytest run in a child, 7-10 s: in make test-exhaustive, which CI runs too)."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        from tests.support.ranks import run_ranks

        def test_unmarked(tmp_path):
            run_ranks(print, 2, tmp_path)
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "starts torch.distributed ranks (spawned, or under torchrun): mark it @pytest.mark.distributed" \
        in result.stdout
