"""The ckptfmt command: output, exit codes, and one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main

CLI = [sys.executable, "-m", "ckptfmt.cli"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys, monkeypatch):
    """Run the CLI in this process (fast); the subprocess tests below cover the real script."""
    monkeypatch.setenv("COLUMNS", "200")

    def invoke(*args) -> Result:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return invoke


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "repo"
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(512, 256), "b": torch.zeros(64), "big": torch.randn(256, 512)}, "step": 1}
    ckptfmt.save(state, root / "step-1", step=1, metadata={"run": "cli"})
    state["model"]["w"] = state["model"]["w"] + 1.0
    state["model"]["extra"] = torch.ones(3)
    state["step"] = 2
    ckptfmt.save(state, root / "step-2", step=2)
    return root


def test_ls_lists_checkpoints_with_step_and_sizes(repo, run):
    result = run("ls", repo, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["name"], r["step"], r["parent"]) for r in rows] == [("step-1", 1, None), ("step-2", 2, "step-1")]
    assert rows[0]["new_bytes"] == rows[0]["stored_bytes"] > 2 * 512 * 256 * 4
    assert 512 * 256 * 4 < rows[1]["new_bytes"] < 2 * 512 * 256 * 4  # "big" is unchanged: shared
    table = run("ls", repo)
    assert "step-1" in table.stdout and "step-2" in table.stdout and "2 checkpoints" in table.stdout


def test_ls_of_a_repository_with_one_checkpoint_says_checkpoint(run):
    url = "memory://ls-one/repo"
    ckptfmt.save({"w": torch.ones(2)}, f"{url}/only", step=1)
    table = run("ls", url)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == [f"{url}:", "1", "checkpoint"]


def test_show_prints_tensors_and_metadata(repo, run):
    result = run("show", repo / "step-1")
    assert result.returncode == 0, result.stderr
    for text in ("model/w", "float32", "(512, 256)", "torch", "determinism", "rng rank 0", "topology"):
        assert text in result.stdout
    data = json.loads(run("show", repo / "step-1", "--json").stdout)
    assert data["step"] == 1 and data["user"] == {"run": "cli"}
    assert {t["key"]: t["shape"] for t in data["tensors"]} == {
        "model/w": [512, 256],
        "model/b": [64],
        "model/big": [256, 512],
    }


def test_show_repository_means_latest(repo, run):
    data = json.loads(run("show", repo, "--json").stdout)
    assert data["name"] == "step-2"


def nested(depth: int) -> dict:
    """User metadata as deep as a value tree may be (255 dicts inside one another)."""
    value: dict = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"inner": value}
    return value


def test_show_prints_user_metadata_of_any_allowed_depth(run, tmp_path):
    """Found by `make fuzz`: show and show --json recursed out on a deep user value tree."""
    url = ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "deep", metadata={"run": nested(255)})
    table = run("show", url)
    assert table.returncode == 0, table.stderr
    assert "inner" in table.stdout and "nested deeper than" in table.stdout
    shown = run("show", url, "--json")
    assert shown.returncode == 0, shown.stderr
    user = json.loads(shown.stdout)["user"]["run"]  # at depth 2 of the document
    for _ in range(29):
        user = user["inner"]
    assert user == {"inner": "<nested deeper than 32 levels>"}


def test_verify_ok_and_damaged(repo, run, tmp_path):
    assert run("verify", repo).returncode == 0
    damaged = tmp_path / "damaged"
    state = {"lost_weights": torch.arange(100_000, dtype=torch.float32), "intact_bias": torch.ones(10)}
    ckptfmt.save(state, damaged / "c1")
    with ckptfmt.open(damaged / "c1") as reader:
        chunk = reader.manifest.chunks[reader.tensor_info("lost_weights").shards[0].pieces[0].chunk]
    path = damaged / "chunks" / chunk.hash[:2] / chunk.hash
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run("verify", damaged)
    assert result.returncode == 1
    assert "corrupt-chunk" in result.stdout and chunk.hash[:16] in result.stdout
    assert "lost_weights" in result.stdout and "intact_bias" not in result.stdout  # names the damaged tensor only
    report = json.loads(run("verify", damaged / "c1", "--json").stdout)
    assert report["ok"] is False and report["problems"][0]["tensors"] == ["lost_weights"]


def test_diff_reports_changed_added_and_unchanged(repo, run):
    data = json.loads(run("diff", repo / "step-1", repo / "step-2", "--json").stdout)
    status = {t["key"]: t["status"] for t in data["tensors"]}
    assert status == {"model/w": "changed", "model/b": "unchanged", "model/big": "unchanged", "model/extra": "added"}
    changed = next(t for t in data["tensors"] if t["key"] == "model/w")
    assert changed["max_abs_diff"] == pytest.approx(1.0) and changed["frac_changed"] == 1.0
    fields = {m["field"] for m in data["metadata"]}
    assert "step" in fields and "user.run" in fields


def test_export_torch_and_safetensors(repo, run, tmp_path):
    from safetensors.torch import load_file

    assert run("export", repo / "step-2", tmp_path / "out.pt", "--format", "torch").returncode == 0
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    expected = ckptfmt.load(repo / "step-2")
    assert state["step"] == 2 and torch.equal(state["model"]["w"], expected["model"]["w"])
    assert run("export", repo / "step-2", tmp_path / "out.safetensors", "--format", "safetensors").returncode == 0
    flat = load_file(tmp_path / "out.safetensors")
    assert set(flat) == {"model/w", "model/b", "model/big", "model/extra"}
    assert torch.equal(flat["model/extra"], torch.ones(3))


@pytest.mark.parametrize("args", [
    ("show", "/nonexistent/repo/ckpt"),
    ("ls", "/nonexistent/repo"),
    ("verify", "/nonexistent/repo"),
    ("show", "memory://nothing/here/at-all"),
])
def test_errors_are_one_line_without_traceback(args):
    result = run_script(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfmt: error:"), result.stderr
    assert "Traceback" not in result.stderr


def test_debug_flag_shows_traceback():
    result = run_script("--debug", "show", "/nonexistent/repo/ckpt")
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_console_script_is_installed():
    result = subprocess.run(["ckptfmt", "--help"], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert result.returncode == 0 and "verify" in result.stdout


def test_export_sharded_safetensors_with_prefix(repo, run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    result = run("export", repo / "step-2", out, "--format", "safetensors", "--max-shard-size", "600KB",
                 "--prefix", "model/")
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"w", "b", "big", "extra"}
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2
    merged = {k: v for shard in shards for k, v in load_file(shard).items()}
    expected = ckptfmt.load(repo / "step-2")["model"]
    assert all(torch.equal(merged[k], expected[k]) for k in index["weight_map"])


def test_import_round_trips_a_torch_file(run, tmp_path):
    state = {"w": torch.randn(4, 4), "step": 3, "pair": (1, 2)}
    torch.save(state, tmp_path / "src.pt")
    result = run("import", tmp_path / "src.pt", tmp_path / "repo" / "imported")
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout
    loaded = ckptfmt.load(tmp_path / "repo" / "imported")
    assert loaded["pair"] == (1, 2) and torch.equal(loaded["w"], state["w"])


# -- names stay whole --------------------------------------------------------------------------------

LONG_NAMES = [f"encoder.layers.{i}.self_attention.query_key_value.weight_with_a_rather_long_name[{i}]"
              for i in range(3)]
LONG_KEYS = [f"model/{name}" for name in LONG_NAMES]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def long_names(tmp_path_factory) -> Path:
    """Two checkpoints whose keys are longer than a pipe's 80 columns (and hold '[', which is rich markup)."""
    root = tmp_path_factory.mktemp("long") / "repo"
    state = {"model": {name: torch.full((4, 4), float(i)) for i, name in enumerate(LONG_NAMES)}}
    ckptfmt.save(state, root / "a", metadata={"note": "[bold]not markup[/bold] [/]"})
    state["model"][LONG_NAMES[1]] = state["model"][LONG_NAMES[1]] + 1
    ckptfmt.save(state, root / "b")
    return root


def whole_lines(output: str, names: list[str]) -> list[str]:
    """The names that do not appear whole on one line of ``output``."""
    lines = ANSI.sub("", output).splitlines()
    return [name for name in names if not any(name in line for line in lines)]


@pytest.mark.parametrize("command", ["show", "diff"])
def test_names_stay_whole_in_a_pipe(long_names, command):
    """Piped output (rich's 80 columns) used to fold keys over several lines."""
    args = ["show", long_names / "b"] if command == "show" else ["diff", long_names / "a", long_names / "b"]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR")}
    result = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == (0 if command == "show" else 1), result.stderr  # diff: the states differ
    assert whole_lines(result.stdout, LONG_KEYS if command == "show" else LONG_KEYS[1:2]) == []


def unfolded(output: str, names: list[str]) -> list[str]:
    """The names that appear on no line of ``output`` whole or shortened in the middle ('start…end')."""
    words = ANSI.sub("", output).replace(",", " ").split()
    return [name for name in names if not any(
        word == name or ("…" in word and name.startswith(word.split("…")[0]) and name.endswith(word.split("…")[1]))
        for word in words)]


@pytest.mark.parametrize("command", ["show", "diff", "ls", "verify"])
def test_names_stay_whole_in_a_narrow_terminal(long_names, run, monkeypatch, tmp_path, command):
    """A 40-column terminal: output fits it, and names stay on one line, shortened in the middle if wider."""
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the captured output as a terminal
    damaged = tmp_path / "repo"
    if command == "verify":  # a damaged chunk: the table names the tensors that use it
        shutil.copytree(long_names, damaged)
        chunk = next(p for p in (damaged / "chunks").rglob("*") if p.is_file())
        data = chunk.read_bytes()
        chunk.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    args = {"show": ["show", long_names / "b"], "diff": ["diff", long_names / "a", long_names / "b"],
            "ls": ["ls", long_names], "verify": ["verify", damaged]}[command]
    result = run(*args)
    assert result.returncode == (1 if command in ("verify", "diff") else 0), result.stderr
    expected = {"show": LONG_KEYS, "diff": LONG_KEYS[1:2], "ls": ["a", "b"], "verify": LONG_KEYS}[command]
    assert unfolded(result.stdout, expected) == []
    # Only a path (the repository's, a damaged chunk's) overflows, whole on a line of its own, to be copied.
    wide = [line for line in ANSI.sub("", result.stdout).splitlines() if len(line) > 40]
    assert [line for line in wide if len(line.split()) != 1 or "/" not in line] == []


def test_metadata_is_never_read_as_markup(long_names, run):
    result = run("show", long_names / "a")
    assert result.returncode == 0, result.stderr
    assert "[bold]not markup[/bold] [/]" in result.stdout


def test_library_warnings_print_as_one_line_each(long_names, run):
    """A stray entry in a repository: ls works and says what it ignored, as ckptfmt's warning, once."""
    (long_names / "notes").mkdir(exist_ok=True)
    result = run("verify", long_names)
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("ckptfmt: warning: ")] != []
    assert "notes" in result.stderr
    report = json.loads(run("verify", long_names, "--json").stdout)
    assert any("notes" in w for w in report["warnings"])
