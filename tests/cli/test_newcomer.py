"""A new user's path through the command line (issue 27, 6): exit codes a CI job can gate on, --debug
anywhere, a closed pipe that is no error, show's tensors whole into a pipe and filtered, "did you mean",
no meaningless rates, the paths Lightning users know, a missing bucket named, and an install that works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from tests.support.helpers import script_env

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ckptfmt.cli"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """60 tensors in one checkpoint; a second checkpoint of the same state, a third with one tensor moved."""
    root = tmp_path_factory.mktemp("newcomer") / "repo"
    state = {"model": {f"layer{i}": {"weight": torch.full((4,), float(i))} for i in range(60)}, "lr": 0.1}
    ckptfmt.save(state, root / "a", step=1)
    ckptfmt.save(state, root / "same", step=2)
    state["model"]["layer7"]["weight"] = torch.zeros(4)
    ckptfmt.save(state, root / "moved", step=3)
    return root


def run(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=env or script_env())


def test_diff_exits_1_when_the_states_differ_and_0_when_they_do_not(repo, capsys):
    assert main(["diff", str(repo / "a"), str(repo / "same")]) == 0  # saved apart: only metadata differs
    assert main(["diff", str(repo / "a"), str(repo / "moved")]) == 1
    assert main(["diff", str(repo / "a"), str(repo / "moved"), "--json"]) == 1
    assert main(["diff", str(repo / "a"), str(repo / "nothing")]) == 2
    capsys.readouterr()


def test_compare_exits_1_when_the_runs_differ(tmp_path, capsys):
    for name, value in (("one", 1.0), ("two", 1.0), ("other", 2.0)):
        ckptfmt.save({"w": torch.full((8,), value)}, tmp_path / name / "step-1", step=1)
    pytest.importorskip("pyarrow")
    assert main(["compare", str(tmp_path / "one"), str(tmp_path / "two")]) == 0
    assert main(["compare", str(tmp_path / "one"), str(tmp_path / "other")]) == 1
    assert main(["compare", str(tmp_path / "one"), str(tmp_path / "other"), "--json"]) == 1
    capsys.readouterr()


def test_debug_is_taken_after_the_command_too(repo, tmp_path):
    assert run("ls", repo, "--debug").returncode == 0
    failed = run("ls", tmp_path / "missing", "--debug")
    assert failed.returncode == 2 and "Traceback" in failed.stderr  # --debug shows it
    assert "Traceback" not in run("ls", tmp_path / "missing").stderr
    assert main(["analytics", "export", str(tmp_path / "missing"), str(tmp_path / "out"), "--debug"]) == 2


@pytest.mark.parametrize("args", [["show", "{repo}/a"], ["show", "{repo}/a", "--json"], ["ls", "{repo}"]])
def test_a_closed_pipe_ends_the_command_quietly(repo, args):
    command = " ".join([*map(str, CLI), *(a.format(repo=repo) for a in args)])
    result = subprocess.run(["bash", "-o", "pipefail", "-c", f"{command} | head -n 1"], capture_output=True,
                            text=True, timeout=120, env=script_env())
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and len(result.stdout.splitlines()) == 1


def test_show_lists_every_tensor_into_a_pipe_and_filters(repo):
    piped = run("show", repo / "a").stdout
    assert "tensors (60 of 60)" in piped and "model/layer59/weight" in piped
    assert len([line for line in piped.splitlines() if line.startswith("model/layer")]) == 60
    only = run("show", repo / "a", "--filter", "layer4").stdout
    assert "tensors matching 'layer4' (11 of 11)" in only and "model/layer40/weight" in only
    assert "model/layer5/weight" not in only
    globbed = run("show", repo / "a", "--filter", "model/layer?/weight").stdout
    assert "(10 of 10)" in globbed
    assert "did you mean" in run("show", repo / "a", "--filter", "model/layr7/weight").stdout


def test_show_in_a_terminal_keeps_its_limit_and_says_so(repo, capsys, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["show", str(repo / "a")]) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "tensors (50 of 60)" in out and "10 more: --limit 0 lists every tensor" in " ".join(out.split())


def test_a_mistyped_key_gets_a_did_you_mean(repo):
    with ckptfmt.open(repo / "a") as reader, pytest.raises(ckptfmt.CheckpointNotFoundError,
                                                           match=r"did you mean 'model/layer7/weight'"):
        reader.get_tensor("model/layr7/weight")


def test_verify_of_a_small_repository_prints_no_meaningless_rate(repo):
    out = run("verify", repo).stdout
    assert out.startswith("OK: 3 checkpoints") and "GB/s" not in out and "0.00" not in out


def test_paths_lightning_users_know_are_taken_and_listed(tmp_path):
    pytest.importorskip("lightning")
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    plugin = CkptfmtCheckpointIO()
    run_dir = tmp_path / "lit"
    for step in range(3):
        plugin.save_checkpoint({"state_dict": {"w": torch.full((2,), float(step))}, "global_step": step},
                               run_dir / "last.ckpt")
    plugin.teardown()
    assert torch.equal(ckptfmt.load(run_dir / "last.ckpt")["state_dict"]["w"], torch.full((2,), 2.0))
    shown = run("show", run_dir / "last.ckpt")
    assert shown.returncode == 0, shown.stderr
    assert run("verify", run_dir / "last.ckpt").returncode == 0
    listed = run("ls", run_dir).stdout
    (row,) = [line for line in listed.splitlines() if "(last.ckpt)" in line]
    assert re.search(r"\S+ \(removed\)$", row), row  # its parent, the previous last, was removed
    missing = run("show", run_dir / "best.ckpt")
    assert missing.returncode == 2 and "no checkpoint and no ckptfmt pointer there" in missing.stderr


@pytest.mark.s3
def test_a_missing_bucket_is_named(s3_server):
    result = run("ls", "s3://no-such-bucket-anywhere/runs", env={**script_env(), **{
        k: v for k, v in os.environ.items() if k.startswith("AWS_")}})
    assert result.returncode == 2
    assert "the bucket 'no-such-bucket-anywhere' does not exist" in result.stderr, result.stderr


def test_the_readme_install_works_from_a_clone_and_quotes_its_extras():
    """No package index has ckptfmt; unquoted brackets break in zsh; an unpinned torch pulls CUDA."""
    texts = {path: path.read_text() for path in [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")]}
    installs = [(path.name, line) for path, text in texts.items() for line in text.splitlines()
                if re.search(r"\bpip install\b", line) and "ckptfmt" in line]
    assert installs
    for where, line in installs:
        for target in re.findall(r"pip install (?:-\S+ )*(\S+)", line):
            if "[" in target:
                assert target[0] in "'\"", (where, line)  # quoted for zsh
            assert not re.fullmatch(r"['\"]?ckptfmt(\[[^]]*\])?['\"]?", target), (where, line)  # not on an index
    readme = texts[ROOT / "README.md"]
    install = readme[readme.index("## Install"):readme.index("## Quickstart")]
    assert "download.pytorch.org/whl/cpu" in install and "python -m build" in install
