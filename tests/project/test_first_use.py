"""What a new user meets first: documented names, checkpoint URLs, the version."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import kernels
from tests.support.documents import documented_paths, in_own_package

ROOT = Path(__file__).resolve().parents[2]


def test_every_documented_dotted_path_works_after_import_ckptfmt():
    paths = sorted(path for path in documented_paths() if not in_own_package(path))
    assert "ckptfmt.dcp.StorageWriter" in paths and "ckptfmt.analytics.tables" in paths
    probe = ("import sys, ckptfmt\n"
             "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported eagerly'\n"
             "assert 'pyarrow' not in sys.modules, 'imported eagerly'\n"
             f"for path in {paths!r}:\n"
             "    value = ckptfmt\n"
             "    for part in path.split('.')[1:]:\n"
             "        value = getattr(value, part)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_documented_module_of_the_optional_packages_imports():
    """ckptfmt.converters, ckptfmt.tui and ckptfmt.integrations.<framework> are imported by name."""
    names = sorted(path for path in documented_paths() if in_own_package(path))
    assert "ckptfmt.integrations.lightning" in names
    for name in names:
        importlib.import_module(name)


def test_an_unknown_attribute_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckptfmt.nope  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize("url", ["foo", "s3://bucket", "memory://name"])
def test_a_bare_name_is_refused_and_creates_nothing(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckptfmt.InvalidNameError, match="a checkpoint URL is REPO/NAME"):
        ckptfmt.save({"w": torch.ones(2)}, url)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_in_the_current_folder_is_said_explicitly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckptfmt.save({"w": torch.ones(2)}, "./step-1")
    assert (tmp_path / "ckptfmt.json").exists() and ckptfmt.load(".")["w"].sum() == 2


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfmt.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_import_into_a_bare_name_is_one_error_line_and_creates_nothing(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    result = cli("import", "ok.pt", "justname", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ckptfmt: error: 'justname': a checkpoint URL is REPO/NAME (e.g. runs/exp1/step-000100), not a bare name"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.pt"]


def test_version(tmp_path):
    result = cli("--version", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip().splitlines() == [f"ckptfmt {ckptfmt.__version__}, reads format 1.0-2.1, writes 2.1",
                                                  f"kernels: {kernels.describe()}"]
    if os.environ.get("CKPTFMT_CI"):  # make setup builds the C kernels wherever CI runs (it has a compiler)
        assert kernels.describe().startswith("native (C, ")
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", ckptfmt.__version__)
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    assert f"\n## {ckptfmt.__version__} " in changelog, "every release has its CHANGELOG.md section"
