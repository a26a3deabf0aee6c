"""The torch line (docs/architecture.md): a core that knows only bytes. The format, the storage and the
repository never import torch, and every inspecting command, ``import ckptfmt`` and the replication child
run without loading it: torch costs seconds and hundreds of MB, and looking at a checkpoint needs none of it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.lifecycle import housekeeping_process
from tests.support.helpers import script_env

ROOT = Path(__file__).resolve().parents[2]
#: The packages below the line: no import of torch anywhere in them, not even inside a function.
BYTES_ONLY = ("format", "storage", "repository")
#: Modules above those packages that the inspecting commands use: importing them loads no torch.
BYTE_LEVEL_MODULES = [
    "ckptfmt", "ckptfmt.cli", "ckptfmt.loading.checkpoint", "ckptfmt.loading.chunkio", "ckptfmt.tools.verify",
    "ckptfmt.tools.diff", "ckptfmt.tools.describe", "ckptfmt.lifecycle.gc", "ckptfmt.lifecycle.retention",
    "ckptfmt.lifecycle.replicate", "ckptfmt.lifecycle.repair", "ckptfmt.lifecycle.signing",
    "ckptfmt.lifecycle.housekeeping_process", "ckptfmt.lifecycle.advise", "ckptfmt.converters", "ckptfmt.tui.app",
    "ckptfmt.tui.screens.checkpoint", "ckptfmt.tui.screens.diff", "ckptfmt.tui.screens.verify",
    "ckptfmt.analytics", "ckptfmt.analytics.tables", "ckptfmt.analytics.stragglers", "ckptfmt.analytics.goodput",
    "ckptfmt.analytics.dataset", "ckptfmt.analytics.table_worker",
]


def torch_imports(path: Path) -> list[int]:
    """The lines of ``path`` that import torch, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(name == "torch" or name.startswith("torch.") for name in names):
            found.append(node.lineno)
    return found


def test_the_packages_below_the_line_never_import_torch():
    offenders = {str(path.relative_to(ROOT)): lines for package in BYTES_ONLY
                 for path in sorted((ROOT / "ckptfmt" / package).rglob("*.py")) if (lines := torch_imports(path))}
    assert offenders == {}


def loaded_torch(program: str, cwd: Path | None = None) -> list[str]:
    """The torch modules a fresh interpreter has loaded after running ``program``."""
    probe = program + ("\nimport json, sys\n"
                       "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=cwd,
                            env=script_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_byte_level_modules_loads_no_torch():
    assert loaded_torch("\n".join(f"import {name}" for name in BYTE_LEVEL_MODULES)) == []


def test_every_public_name_still_resolves(tmp_path):
    """``import ckptfmt`` stays the one import users write: every name is there, loaded on first use."""
    assert set(dir(ckptfmt)) >= set(ckptfmt.__all__)
    assert all(getattr(ckptfmt, name) is not None for name in ckptfmt.__all__)
    assert loaded_torch("import ckptfmt; ckptfmt.verify; ckptfmt.Repository; ckptfmt.FORMAT_VERSION") == []
    assert loaded_torch("import ckptfmt; ckptfmt.save") != []  # saving needs torch: loaded when asked for


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """Two checkpoints whose plain values hold a torch dtype, Size and device, and a changed bf16 tensor;
    each holds the steps timed since the one before (for the analytics commands)."""
    root = tmp_path_factory.mktemp("torch-line") / "repo"
    timer = ckptfmt.StepTimer()
    for step in (1, 2):
        for index in range(3):
            with timer.step(step * 10 + index), timer.phase("forward"):
                pass
        state = {"w": torch.full((64,), float(step)), "b": torch.full((8,), float(step)).bfloat16(),
                 "plain": {"dtype": torch.float16, "size": torch.Size([2, step]), "device": torch.device("cpu")}}
        ckptfmt.save(state, root / f"step-{step}", step=step, timer=timer)
    return root


COMMANDS = {
    "--version": ["--version"], "--help": ["--help"], "ls": ["ls", "{repo}"], "show": ["show", "{repo}/step-1"],
    "verify": ["verify", "{repo}"], "diff": ["diff", "{repo}/step-1", "{repo}/step-2"],
    "gc --dry-run": ["gc", "{repo}", "--dry-run"], "sync": ["sync", "{repo}", "{copy}"],
    "stragglers": ["stragglers", "{repo}"], "goodput": ["goodput", "{repo}"],
    "analytics export": ["analytics", "export", "{repo}", "{copy}"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_inspecting_commands_run_without_torch(repo, tmp_path, command):
    argv = [a.format(repo=repo, copy=tmp_path / "copy") for a in COMMANDS[command]]
    program = textwrap.dedent(f"""
        import contextlib, io
        from ckptfmt.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                code = main({argv!r})
            except SystemExit as exit:  # --version and --help
                code = exit.code
        assert code in (0, 1), (code, out.getvalue())
    """)
    assert loaded_torch(program) == []


def test_diff_measures_changed_tensors_and_compares_torch_values_without_torch(repo):
    program = textwrap.dedent(f"""
        from ckptfmt.tools.diff import diff
        report = diff({str(repo / 'step-1')!r}, {str(repo / 'step-2')!r})
        moved = {{t.key: t.max_abs_diff for t in report.tensors}}
        assert moved == {{"w": 1.0, "b": 1.0}}, moved
        assert [(k, repr(a), repr(b)) for k, a, b in report.values] == [
            ("plain/size", "torch.Size([2, 1])", "torch.Size([2, 2])")], report.values
    """)
    assert loaded_torch(program) == []


def test_the_replication_child_runs_without_torch(tmp_path, monkeypatch):
    """The child that copies checkpoints to the slower tier fails at once if anything makes it import torch."""
    guard = ("import sys\nclass _NoTorch:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'torch' or name.startswith('torch.'):\n"
             "            raise ImportError('the replication child imported torch')\n"
             "sys.meta_path.insert(0, _NoTorch())\n")
    monkeypatch.setattr(housekeeping_process, "_CHILD", guard + housekeeping_process._CHILD.replace("; ", "\n"))
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    manager = ckptfmt.CheckpointManager(tiers=[str(fast), str(slow)], housekeeping="process")
    for step in (1, 2):
        manager.save(step, {"w": torch.full((32,), float(step))})
    manager.wait()
    manager.close()
    assert [r.step for r in ckptfmt.Repository.open(slow).commits()] == [1, 2]


def test_the_analytics_names_stay_functions_whichever_module_loads_first():
    """``ckptfmt.analytics`` loads its names on first use; its submodules are named as their functions, and
    importing one first (as the CLI does) still leaves ``analytics.tables`` the function, not the module."""
    program = textwrap.dedent("""
        import ckptfmt.analytics.tables, ckptfmt.analytics.certify
        from ckptfmt.analytics.stragglers import Thresholds
        from ckptfmt import analytics
        import types
        names = ("tables", "certify", "stragglers", "goodput", "health", "compare", "export_incremental")
        kinds = {name: type(getattr(analytics, name)).__name__ for name in names}
        assert kinds == dict.fromkeys(names, "function"), kinds
        assert analytics.Thresholds is Thresholds and set(analytics.__all__) <= set(dir(analytics))
        assert not any(isinstance(getattr(analytics, name), types.ModuleType) for name in analytics.__all__)
    """)
    assert "torch" in loaded_torch(program)  # certify reads tensors: torch loads with it, and only then
