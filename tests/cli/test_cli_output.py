"""What every CLI command prints, in an 80-column terminal and into a pipe.

In a terminal every line fits 80 columns and no value is split over two lines
(a shape '(10, 256)', a size '996.1 KiB'): long names are shortened in the
middle ('start…end') or moved to a line of their own. Into a pipe every record
is one plain line, values whole, without trailing spaces, escape codes or box
drawing; ``--json`` holds everything. The commands run on real repositories:
long tensor keys and checkpoint names, big shapes, a damaged copy, two
differing checkpoints, single-process runs with step records and a 2-rank
gloo run with a straggler.

The terminal is rich's (TTY_COMPATIBLE=1, COLUMNS=80, in this process); one test
runs the real command under a real 80-column pseudo-terminal to show that it
is the same.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.analytics.tables import TABLE_NAMES
from ckptfmt.cli import main
from ckptfmt.tools.formatting import human_bytes, shape_text

WIDTH = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
BOX_DRAWING = re.compile("[\u2500-\u257f]")

LONG_KEY = "encoder.layers.11.self_attention.query_key_value.lora_A.default.weight"
NAMES = [f"experiment-with-a-rather-long-descriptive-name-2024-06-01-step-00000{i}" for i in (1, 2)]


@dataclass
class Result:
    code: int
    out: str
    err: str


def cli(capsys, *args) -> Result:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


@pytest.fixture(params=["terminal", "pipe"])
def mode(request, monkeypatch) -> str:
    """Output to an 80-column terminal (as rich sees one), or into a pipe."""
    for name in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # a pipe gets rich's 80 columns too: it must not wrap there
    monkeypatch.setenv("TERM", "xterm-256color")
    if request.param == "terminal":
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    return request.param


@pytest.fixture
def run(mode, capsys):
    return lambda *args: cli(capsys, *args)


# -- what good output is -------------------------------------------------------------------------------------


def json_of(result: Result):
    """A --json output (rich colours it in a terminal)."""
    assert result.code in (0, 1), result.err
    return json.loads(ANSI.sub("", result.out))


def lines_of(text: str) -> list[str]:
    return ANSI.sub("", text).splitlines()


def words(text: str) -> str:
    """The text's words, one space apart (a phrase wrapped over lines reads whole)."""
    return " ".join(ANSI.sub("", text).split())


def check_layout(mode: str, text: str) -> None:
    """Fits 80 columns in a terminal; plain lines into a pipe; never trailing spaces."""
    lines = lines_of(text)
    assert [line for line in lines if line != line.rstrip()] == []
    if mode == "terminal":  # only a path may overflow, whole on a line of its own (a user copies it)
        assert [line for line in lines if len(line) > WIDTH and not overflows_with_a_path(line)] == []
    else:
        assert "\x1b" not in text and not BOX_DRAWING.search(text), text


def overflows_with_a_path(line: str) -> bool:
    """Whether ``line`` is a path alone (indented as its column is), wider than the terminal."""
    return len(line.split()) == 1 and "/" in line


def split(text: str, values: list[str]) -> list[str]:
    """The values that appear whole on no line of ``text``."""
    lines = lines_of(text)
    return [value for value in values if not any(value in line for line in lines)]


def unfolded(mode: str, text: str, names: list[str]) -> list[str]:
    """The names that appear on no line whole (or, in a terminal, shortened in the middle: 'start…end')."""
    if mode == "pipe":
        return split(text, names)
    words = re.split(r"[\s,;:()]+", ANSI.sub("", text))
    return [name for name in names if not any(word == name or shortened(word, name) for word in words)]


def shortened(word: str, name: str) -> bool:
    """Whether ``word`` is ``name`` shortened in the middle: its start, '…', its end."""
    head, ellipsis, tail = word.partition("…")
    return bool(ellipsis) and name.startswith(head) and name.endswith(tail)


def records(text: str, wanted: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The records whose values are not all on one line (one record per line: a pipe's promise)."""
    lines = lines_of(text)
    return [record for record in wanted if not any(all(value in line for value in record) for line in lines)]


# -- repositories -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """Two checkpoints with long names: long keys, big shapes, a dtype change, an added and a removed tensor,
    another learning rate, and metadata values longer than a line."""
    root = tmp_path_factory.mktemp("output") / "repo"
    torch.manual_seed(0)
    model = {LONG_KEY: torch.randn(10, 256), "embed.weight": torch.randn(250, 1020),
             "mlp.dense_h_to_4h.weight": torch.randn(1024, 4, 8), "bias": torch.zeros(64)}
    state = {"model": model, "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.999)}]}}
    ckptfmt.save(state, root / NAMES[0], step=1, metadata={"notes": "x" * 300, "layers": list(range(40))})
    model[LONG_KEY] = model[LONG_KEY] + 1
    model["embed.weight"] = model["embed.weight"].to(torch.bfloat16)
    model["added"] = torch.ones(3)
    del model["bias"]
    state["optim"]["param_groups"][0]["lr"] = 0.05
    ckptfmt.save(state, root / NAMES[1], step=2, metadata={"notes": "y" * 300})
    return root


@pytest.fixture(scope="module")
def damaged(repo, tmp_path_factory) -> Path:
    """A copy of ``repo`` with one chunk flipped and one missing."""
    copy = tmp_path_factory.mktemp("damaged") / "repo"
    shutil.copytree(repo, copy)
    chunks = sorted(p for p in (copy / "chunks").rglob("*") if p.is_file())
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[0].write_bytes(bytes(data))
    chunks[1].unlink()
    return copy


def tensor_values(url: Path) -> tuple[list[tuple[str, ...]], list[str]]:
    """Each tensor's (key, dtype, shape, size) as show prints them, and the shapes and sizes alone."""
    with ckptfmt.open(url) as ckpt:
        infos = [ckpt.tensor_info(key) for key in ckpt.keys()]
    rows = [(t.key, t.dtype, shape_text(t.shape), human_bytes(t.nbytes)) for t in infos]
    return rows, [value for row in rows for value in row[2:]]


def train(repo: Path, *, lr: float) -> None:
    """A single-process run with step records: 8 steps, a checkpoint every 4."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    timer = ckptfmt.StepTimer()
    for step in range(8):
        with timer.step(step):
            with timer.phase("data"):
                x = torch.randn(8, 16)
                timer.batch(torch.arange(8) + 8 * step)
            with timer.phase("forward"):
                loss = model(x).square().mean()
            with timer.phase("backward"):
                optimizer.zero_grad()
                loss.backward()
            optimizer.step()
        timer.metrics(loss=loss.item())
        if step % 4 == 3:
            ckptfmt.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, repo / f"step-{step:04d}",
                         step=step, timer=timer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two runs that differ in their learning rate only."""
    root = tmp_path_factory.mktemp("runs")
    train(root / "a", lr=0.01)
    train(root / "b", lr=0.05)
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def straggler_run(ddp_runs) -> str:
    """The shared 2-rank DDP run with injected sleeps (tests/support/ddp_runs.py)."""
    return ddp_runs["two"]


# -- ls, show, verify, diff ----------------------------------------------------------------------------------


def test_ls(repo, run, mode):
    result = run("ls", repo)
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    listed = json_of(run("ls", repo, "--json"))
    sizes = [human_bytes(r["stored_bytes"]) for r in listed]
    assert split(result.out, sizes) == []  # '996.5 K…' was cut
    assert unfolded(mode, result.out, NAMES) == []
    if mode == "pipe":
        assert records(result.out, [(r["name"], human_bytes(r["stored_bytes"]), r["parent"] or "-")
                                    for r in listed]) == []


def test_show(repo, run, mode):
    result = run("show", repo / NAMES[1])
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    rows, values = tensor_values(repo / NAMES[1])
    assert "(250, 1020)" in values and "(1024, 4, 8)" in values
    assert split(result.out, values) == []
    assert unfolded(mode, result.out, [row[0] for row in rows]) == []
    if mode == "pipe":
        assert records(result.out, rows) == []


def test_show_json_lists_every_tensor_whatever_the_limit(repo, run):
    shown = json_of(run("show", repo / NAMES[1], "--json", "--limit", "1"))
    rows, _ = tensor_values(repo / NAMES[1])
    assert [(t["key"], t["dtype"], shape_text(t["shape"]), human_bytes(t["bytes"])) for t in shown["tensors"]] == rows
    assert shown["user"]["notes"] == "y" * 300


def test_verify_intact(repo, run, mode):
    result = run("verify", repo)
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert lines_of(result.out)[0].startswith("OK: 2 checkpoint")


def test_verify_damaged(damaged, run, mode):
    result = run("verify", damaged)
    assert result.code == 1, result.err
    check_layout(mode, result.out)  # a damaged verify printed 228-column lines
    report = json_of(run("verify", damaged, "--json"))
    problems = report["problems"]
    assert {p["kind"] for p in problems} == {"corrupt-chunk", "missing-chunk"}
    assert unfolded(mode, result.out, [name for p in problems for name in (p["checkpoint"], *p["tensors"])]) == []
    paths = [p["key"] for p in problems]  # the damaged chunks' paths: whole, to be copied (not 'chunks/63/6308…535c')
    assert len(paths) == 2 and split(result.out, paths) == []
    if mode == "pipe":
        assert records(result.out, [(p["checkpoint"], p["kind"], ", ".join(p["tensors"]), p["message"])
                                    for p in problems]) == []


def test_diff(repo, run, mode):
    result = run("diff", repo / NAMES[0], repo / NAMES[1])
    assert result.code == 1, result.err  # they differ (exit codes: docs/usage.md)
    check_layout(mode, result.out)  # its table was 93 columns, shapes split as '(10,' / '256)'
    assert split(result.out, ["(10, 256)", "float32 -> bfloat16", "(250, 1020)", "(64) -> -", "- -> (3)"]) == []
    assert unfolded(mode, result.out, [f"model/{LONG_KEY}", "model/embed.weight"]) == []
    assert records(result.out, [("optim/param_groups/0/lr", "0.01", "0.05")]) == []  # values that differ
    if mode == "pipe":
        assert records(result.out, [(f"model/{LONG_KEY}", "changed", "float32", "(10, 256)"),
                                    ("model/embed.weight", "changed", "float32 -> bfloat16", "(250, 1020)"),
                                    ("user.notes", "x" * 150, "y" * 150)]) == []


def test_diff_json_holds_tensors_values_and_metadata(repo, run):
    report = json_of(run("diff", repo / NAMES[0], repo / NAMES[1], "--json"))
    assert {t["key"]: t["status"] for t in report["tensors"]} == {
        f"model/{LONG_KEY}": "changed", "model/embed.weight": "changed", "model/mlp.dense_h_to_4h.weight": "unchanged",
        "model/added": "added", "model/bias": "removed"}
    assert report["values"] == [{"key": "optim/param_groups/0/lr", "a": 0.01, "b": 0.05}]
    fields = {m["field"]: (m["a"], m["b"]) for m in report["metadata"]}
    assert fields["user.notes"] == ("x" * 300, "y" * 300) and fields["step"] == (1, 2)


# -- rm, gc, sync --------------------------------------------------------------------------------------------


@pytest.fixture
def copy(repo, tmp_path) -> Path:
    shutil.copytree(repo, tmp_path / "copy")
    return tmp_path / "copy"


def test_rm(copy, run, mode):
    result = run("rm", copy / NAMES[0])
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert unfolded(mode, result.out, [NAMES[0]]) == []
    assert ckptfmt.Repository.open(copy).names() == [NAMES[1]]


@pytest.mark.parametrize("dry_run", [True, False])
def test_gc(copy, run, mode, dry_run):
    result = run("gc", copy, "--keep-last", "1", *["--dry-run"] * dry_run)
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert unfolded(mode, result.out, [NAMES[0]]) == []
    assert len(lines_of(result.out)) == 1 or mode == "terminal"
    again = json_of(run("gc", copy, "--keep-last", "1", "--dry-run", "--json"))
    assert again["checkpoints"] == ([NAMES[0]] if dry_run else [])


def test_sync(repo, run, mode, tmp_path):
    result = run("sync", repo, tmp_path / "replica")
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert len(lines_of(result.out)) == 1 or mode == "terminal"
    assert json_of(run("sync", repo, tmp_path / "replica", "--json"))["present"] == NAMES


@pytest.mark.parametrize("dry_run", [True, False])
def test_repair(damaged, repo, run, mode, tmp_path, dry_run):
    target = tmp_path / "target"
    shutil.copytree(damaged, target)
    result = run("repair", target, "--from", repo, *["--dry-run"] * dry_run)
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    fixed = json_of(run("repair", target, "--from", repo, "--dry-run", "--json"))["repaired"]
    assert len(fixed) == (2 if dry_run else 0)
    if dry_run:
        assert "would repair 2 objects" in words(result.out)
        assert unfolded(mode, result.out, [f["key"] for f in fixed]) == []
        if mode == "pipe":
            assert records(result.out, [(f["key"], f["kind"], f["source"]) for f in fixed]) == []


def test_repair_without_a_good_copy(damaged, run, mode):
    result = run("repair", damaged)
    assert result.code == 1, result.err
    check_layout(mode, result.out)
    left = json_of(run("repair", damaged, "--json"))["unrepaired"]
    assert len(left) == 2 and all(u["tensors"] for u in left)
    assert unfolded(mode, result.out, [u["checkpoint"] for u in left] + [t for u in left for t in u["tensors"]]) == []


def test_protect(copy, run, mode):
    result = run("protect", copy, "--parity", "3+1")
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert unfolded(mode, result.out, NAMES) == []
    assert "with parity 3+1" in words(result.out)
    doc = json_of(run("protect", copy, "--parity", "3+1", "--json"))
    assert doc["unchanged"] == NAMES and doc["protected"] == []


def test_verify_and_repair_from_parity(copy, run, mode):
    assert run("protect", copy, "--parity", "2+1").code == 0
    chunks = sorted(p for p in (copy / "chunks").rglob("*") if p.is_file())
    chunks[0].unlink()
    result = run("verify", copy)
    assert result.code == 1
    check_layout(mode, result.out)
    assert "parity 2+1 can rebuild it" in words(result.out) and "parity can rebuild 1 of them" in words(result.out)
    problems = json_of(run("verify", copy, "--json"))["problems"]
    assert [p["parity"] for p in problems] == ["parity 2+1 can rebuild it"]
    result = run("repair", copy)
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert "repaired 1 object" in words(result.out) and "parity 2+1" in words(result.out)


# -- the analytics commands ----------------------------------------------------------------------------------


def test_advise(runs, run, mode):
    result = run("advise", runs[0])
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    advice = json_of(run("advise", runs[0], "--json"))
    assert records(result.out, [("Daly (advice)", str(advice["daly"]["steps"]))]) == []


def test_stragglers_none_found(runs, run, mode):
    result = run("stragglers", runs[0])
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert "no stragglers found" in result.out  # was an empty table
    assert json_of(run("stragglers", runs[0], "--json"))["stragglers"] == []


def test_stragglers_table(straggler_run, run, mode):
    report = json_of(run("stragglers", straggler_run, "--json"))
    assert report["stragglers"], "the sleeping rank was not found: nothing to print"
    result = run("stragglers", straggler_run)
    assert result.code == 1, result.err  # stragglers found
    check_layout(mode, result.out)
    lines = lines_of(result.out)
    for found in report["stragglers"]:
        ratio = "-" if found["ratio"] is None else f"{found['ratio']:.1f}x"
        row = [line for line in lines if line.split()[:1] == [str(found["rank"])] and found["phase"] in line]
        assert len(row) == 1 and row[0].split()[-1] == ratio, (row, found)
    unknown = any(found["ratio"] is None for found in report["stragglers"])
    assert ("x median -: " in result.out) is unknown  # a ratio to a near-zero median is shown as none


def test_compare(runs, run, mode):
    result = run("compare", *runs)
    assert result.code == 1, result.err  # the runs differ
    check_layout(mode, result.out)
    report = json_of(run("compare", *runs, "--json"))
    lr = next(d for d in report["differences"] if d["field"] == "optim/param_groups/0/lr")
    assert lr["kind"] == "hyperparameters"
    wanted = ("optim/param_groups/0/lr", "hyperparameters", "0.01", "0.05")
    if mode == "pipe":
        assert records(result.out, [wanted]) == []
    else:
        assert split(result.out, list(wanted)) == []
    assert "the runs are different" in words(result.out)


def test_compare_identical(runs, run, mode):
    result = run("compare", runs[0], runs[0])
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert "identical bit for bit" in words(result.out)


def test_report(runs, run, mode, tmp_path):
    result = run("report", runs[0], "--html", tmp_path / "report.html")
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert (tmp_path / "report.html").stat().st_size > 10_000


def test_analytics_export(runs, run, mode, tmp_path):
    out = tmp_path / "a-folder-with-a-long-name-for-the-tables-of-the-run"
    result = run("analytics", "export", runs[0], out, "--format", "csv")
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    files = sorted(str(path) for path in out.iterdir())
    assert len(files) == len(TABLE_NAMES) and unfolded(mode, result.out, files) == []


def test_health(runs, run, mode):
    result = run("health", runs[0], "--deep")
    assert result.code == 0, result.err
    check_layout(mode, result.out)
    assert "NaN/Inf: none in any checkpoint" in words(result.out) and "relative updates" in words(result.out)


# -- import, export, the TUI ---------------------------------------------------------------------------------


def test_import_and_export(repo, run, mode, tmp_path):
    torch.save({"w": torch.ones(3, 4)}, tmp_path / "plain.pt")
    destination = tmp_path / "repo" / NAMES[0]
    imported = run("import", tmp_path / "plain.pt", destination)
    assert imported.code == 0, imported.err
    check_layout(mode, imported.out)
    assert unfolded(mode, imported.out, [str(destination)]) == [] and split(imported.out, ["1 tensor,"]) == []
    exported = run("export", repo / NAMES[1], tmp_path / "out.safetensors", "--format", "safetensors")
    assert exported.code == 0, exported.err
    check_layout(mode, exported.out)
    assert any(re.search(r"\(4 tensors, \d+\.\d KiB\)", line) for line in lines_of(exported.out)), exported.out
    if mode == "pipe":
        assert lines_of(imported.out)[0].startswith("imported ") and str(destination) in lines_of(imported.out)[0]


def test_tui_refuses_a_pipe(repo):
    """`ckptfmt tui REPO | cat` started the TUI, wrote escape codes into the pipe and hung."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "tui", str(repo)], capture_output=True,
                            stdin=subprocess.DEVNULL, timeout=60)
    assert result.returncode == 2 and result.stdout == b"", result.stdout[:200]
    assert result.stderr.decode().count("\n") == 1 and b"needs a terminal" in result.stderr
    assert time.monotonic() - started < 60


# -- errors --------------------------------------------------------------------------------------------------


def test_error_lines(run, mode, tmp_path):
    missing = tmp_path / "a-repository-path-long-enough-to-need-more-than-one-line-of-an-80-column-terminal"
    result = run("ls", missing)
    assert result.code == 2 and result.out == ""
    check_layout(mode, result.err)
    lines = lines_of(result.err)
    assert lines[0].startswith("ckptfmt: error:")
    assert len(lines) == 1 if mode == "pipe" else len(lines) > 1  # one record; wrapped to fit a terminal


def test_usage_error_lines(mode, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["advise", "run", "--mtbf", "an-hour-and-a-half-or-so"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    check_layout(mode, err)
    lines = lines_of(err)
    assert lines[0].startswith("usage: ckptfmt advise") and "'an-hour-and-a-half-or-so'" in err
    assert len(lines) == 2 if mode == "pipe" else len(lines) > 2  # usage, then the error: one line, or wrapped


# -- a real terminal -----------------------------------------------------------------------------------------


def in_a_terminal(*args: str, columns: int = WIDTH, expect: int = 0) -> str:
    """The command's stdout through a real pseudo-terminal ``columns`` wide (stderr to a pipe)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    process = subprocess.Popen([sys.executable, "-m", "ckptfmt.cli", *args], stdout=follower, stdin=follower,
                               stderr=subprocess.PIPE, env={**env, "TERM": "xterm-256color"})
    os.close(follower)
    output = b""
    while select.select([leader], [], [], 120)[0]:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the command has exited and closed the terminal
            break
        if not data:
            break
        output += data
    os.close(leader)
    assert process.wait(timeout=60) == expect, process.stderr.read()
    return output.decode().replace("\r\n", "\n")


def test_a_real_80_column_terminal(repo):
    text = in_a_terminal("diff", str(repo / NAMES[0]), str(repo / NAMES[1]), expect=1)  # they differ
    assert "\x1b[" in text  # styled: it is a terminal
    check_layout("terminal", text)
    assert split(text, ["(10, 256)", "(250, 1020)", "float32 -> bfloat16"]) == []
    assert unfolded("terminal", text, [f"model/{LONG_KEY}", "optim/param_groups/0/lr"]) == []


def test_prose_breaks_between_values_only():
    """Sizes, shapes, dates and counts stay whole at any width; a name wider than the line is shortened."""
    from ckptfmt.tools.output import wrap

    values = ["(1024, 1024, 3, 3)", "996.5 KiB", "2024-06-01 10:11:12", "12 changed,", "0.10 GB/s)"]
    text = f"shape {values[0]} size {values[1]} at {values[2]}: {values[3]} (at {values[4]} by {LONG_KEY}"
    for width in range(24, 60):
        lines = [line.plain for line in wrap(text, width, 2)]
        assert all(len(line) <= width for line in lines), (width, lines)
        assert split("\n".join(lines), values) == [], (width, lines)
        assert unfolded("terminal", "\n".join(lines), [LONG_KEY]) == [], (width, lines)
