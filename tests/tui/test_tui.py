"""The terminal UI (ckptfmt.tui): Textual Pilot tests of every screen and action, open time, and tmux.

Checkpoints are tiny and built with fixed seeds in tmp_path.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("textual")

import ckptfmt
from ckptfmt.storage.factory import open_storage
from ckptfmt.tools.verify import VerifyReport
from ckptfmt.tui import create_app
from ckptfmt.tui.screens import verify as verify_screen_module
from ckptfmt.tui.screens.checkpoint import CheckpointScreen
from ckptfmt.tui.screens.diff import DiffScreen
from ckptfmt.tui.screens.repository import RepositoryScreen
from ckptfmt.tui.screens.verify import VerifyScreen
from ckptfmt.tui.stats import tensor_statistics
from ckptfmt.tui.widgets.formatting import split_key
from ckptfmt.tui.widgets.tensor_tree import TensorTree
from tests.support.helpers import rewrite_manifest
from tests.support.tui_driving import SIZE, async_test, cells, settle, text_of
from tests.tui.states import model_state
from tests.tui.terminal import find_node, pressing, snapshot


def test_split_key_and_statistics():
    assert split_key("model/layers.0.attn.weight") == ["model", "layers", "0", "attn", "weight"]
    stats = tensor_statistics(torch.tensor([0.0, 1.0, 3.0, float("nan"), float("inf")]))
    assert (stats.nan, stats.inf, stats.minimum, stats.maximum) == (1, 1, 0.0, 3.0)
    assert stats.zero_fraction == pytest.approx(0.2)
    assert sum(stats.histogram) == 3
    assert tensor_statistics(torch.zeros(0)).numel == 0
    assert tensor_statistics(torch.full((3,), 2, dtype=torch.int64)).histogram == (3,)


@async_test
async def test_repository_screen_lists_sorts_and_opens(repo):
    app = create_app([repo])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, RepositoryScreen)
        table = screen.query_one("#checkpoints")
        rows = cells(table)
        assert [r[1] for r in rows] == ["step-1", "step-2"]
        assert rows[0][2] == "1" and rows[0][6] == "not verified"
        await pilot.press("s", "s")  # created -> size -> new bytes
        assert screen.sort_column == "new bytes"
        screen.sort_by("step")
        screen.sort_by("step")  # again: reversed
        assert [r[1] for r in cells(table)] == ["step-2", "step-1"]
        assert table.cursor_row == 0  # the cursor stays on its checkpoint, step-2, the newest
        await pilot.press("down", "enter")
        await settle(app, pilot)
        assert isinstance(app.screen, CheckpointScreen)
        assert app.screen.reader.name == "step-1"
        await pilot.press("escape")
        assert app.screen is screen


@async_test
async def test_checkpoint_tree_filter_and_statistics(repo):
    app = create_app([f"{repo}/step-1"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, CheckpointScreen)
        tree = screen.query_one(TensorTree)
        top = [child.data.name for child in tree.root.children]
        assert top == ["model"]
        model = tree.root.children[0]
        assert [c.data.name for c in model.children] == ["embed", "layers", "head"]

        await pilot.press("slash")
        await pilot.press(*"head")
        await pilot.pause(0.4)  # the filter applies once typing pauses
        assert "filter 'head': 1 of 5 tensors" in text_of(app, "#summary")
        await pilot.press("enter")  # from the filter to the tree
        assert tree.has_focus
        # the only match is opened: model > head > bias
        bias = tree.root.children[0].children[0].children[0]
        assert bias.data.tensor == "model/head.bias"
        tree.move_cursor(bias)
        await pilot.pause()
        assert "float32" in text_of(app, "#info") and "(4)" in text_of(app, "#info")
        await pilot.press("enter")
        await settle(app, pilot)
        stats = text_of(app, "#stats")
        assert "statistics of 4 values" in stats
        assert "NaN" in stats and "25.00%" in stats  # one zero among four elements
        assert "histogram" in stats

        await pilot.press("escape")  # closes the filter, restores every tensor
        await pilot.pause(0.4)
        assert "5 tensors" in text_of(app, "#summary")
        assert not screen.query_one("#filter").has_class("shown")


@async_test
async def test_metadata_tabs(repo):
    app = create_app([f"{repo}/step-2"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        tabs = screen.query_one("#tabs")
        seen = {}
        for _ in range(6):
            await pilot.press("right_square_bracket")
            await pilot.pause()
            seen[tabs.active] = text_of(app, f"#{tabs.active}-body")
        assert list(seen) == ["environment", "rng", "topology", "timing", "user", "provenance"]
        assert "torch" in seen["environment"] and torch.__version__ in seen["environment"]
        assert "torch_cpu" in seen["rng"]
        assert "world size" in seen["topology"] and "shards written" in seen["topology"]
        assert "save phases, rank 0" in seen["timing"] and "write_chunks" in seen["timing"]
        assert "█" in seen["timing"]
        assert "'note': 'second'" in seen["user"]
        assert "not imported" in seen["provenance"]
        await pilot.press("right_square_bracket")
        assert tabs.active == "tensors"


ODD_METADATA = {  # what another writer (or a hostile one) may put where ckptfmt writes maps and lists
    "environment": {"os": "plan9", "cpu": [1], "gpus": ["x", {"name": "[b]gpu"}], "torch": 3, "determinism": "on",
                    "packages": ["numpy"]},
    "topology": {"world_size": "four", "ranks": {"0": 1}, "parallelism": [2, 2]},
    "timing": {"ranks": [{"rank": [0], "phases": "fast", "total_s": "slow"}], "steps": [None, "x", 0.5]},
    "rng": [{"rank": "zero", "torch_cpu": 5}], "stats": {"tensor_count": "many", "stored_bytes": [1]},
}


@async_test
async def test_metadata_tabs_show_odd_metadata_as_it_is(repo):
    """Spec section 9: readers never fail on metadata. Every tab renders what is there."""
    rewrite_manifest(open_storage(repo), "step-2", lambda doc: doc.update(ODD_METADATA))
    app = create_app([f"{repo}/step-2"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        seen = {tab: text_of(app, f"#{tab}-body")
                for tab in ("environment", "rng", "topology", "timing", "user", "provenance")}
        assert "plan9" in seen["environment"] and "[b]gpu" in seen["environment"]
        assert "zero" in seen["rng"]
        assert "four" in seen["topology"]
        assert "rank [0]" in seen["timing"] and "1 recorded" in seen["timing"]
        assert "stored [1]" in text_of(app, "#summary")


@async_test
async def test_user_tab_shows_metadata_of_any_allowed_depth(tmp_path):
    value: dict = {"leaf": 1}
    for _ in range(254):  # a value tree may nest 256 levels
        value = {"inner": value}
    url = ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "deep", metadata={"run": value})
    app = create_app([url])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "inner" in text_of(app, "#user-body")


def damage_chunk_of(repo: str, key: str) -> None:
    """Flip one byte in the chunk file holding ``key`` of the latest checkpoint."""
    with ckptfmt.open(repo) as reader:
        piece = reader.tensor_info(key).shards[0].pieces[0]
        digest = reader.manifest.chunks[piece.chunk].hash
    path = Path(repo) / "chunks" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[piece.offset] ^= 0xFF
    path.write_bytes(bytes(data))


@async_test
async def test_verify_shows_damaged_tensor(repo):
    damage_chunk_of(repo, "model/new.weight")
    app = create_app([repo])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("v")
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, VerifyScreen)
        assert screen.report is not None and not screen.report.ok
        assert "DAMAGED" in text_of(app, "#result")
        assert "step-2:model/new.weight" in text_of(app, "#result")
        rows = cells(screen.query_one("#problems"))
        assert rows and rows[0][0] == "step-2" and rows[0][1] == "corrupt-chunk"
        assert "model/new.weight" in rows[0][3]
        assert "of" in text_of(app, "#rate") and "/s" in text_of(app, "#rate") and "ETA" in text_of(app, "#rate")
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, RepositoryScreen)
        verified = {r[1]: r[6] for r in cells(app.screen.query_one("#checkpoints"))}
        assert verified == {"step-1": "ok", "step-2": "damaged"}


@async_test
async def test_verify_cancel_with_escape(repo, monkeypatch):
    """A verify that runs until cancelled: progress shows, Escape cancels, a second Escape goes back."""
    def verify_until_cancelled(url, *, storage_options, callback, cancel):
        callback.set_size(1000)
        callback.relative_update(250)
        assert cancel.wait(30)
        return VerifyReport(url=url, checkpoints=["step-1"], bytes_checked=250, cancelled=True)

    monkeypatch.setattr(verify_screen_module, "verify", verify_until_cancelled)
    app = create_app([f"{repo}/step-1"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        await pilot.press("v")
        verifying = app.screen
        assert isinstance(verifying, VerifyScreen)
        deadline = time.monotonic() + 60
        while "250 B of 1000 B" not in text_of(app, "#rate"):  # the progress timer ticks every 0.1 s
            assert time.monotonic() < deadline, text_of(app, "#rate")
            await pilot.pause(0.05)
        assert "ETA" in text_of(app, "#rate")
        assert verifying.query_one("ProgressBar").percentage == pytest.approx(0.25)
        await pilot.press("escape")
        await settle(app, pilot)
        assert "CANCELLED" in text_of(app, "#result")
        assert app.verified == {}  # a cancelled verify proves nothing
        await pilot.press("escape")
        assert app.screen is screen


@async_test
async def test_cancelling_a_real_verify_stops_it_early(s3_bucket, make_s3_proxy):
    """A real verify of 80 chunks on S3 (moto behind the fault proxy), whose reads of chunks 5 to 20
    the proxy holds for 3 s (then drops: the retry reads them): once the first 4 are checked, all 16
    verify threads wait on held reads, and Escape then skips the 60 chunks not started. The worker
    ends, the screen says cancelled, nothing is marked verified."""
    proxy = make_s3_proxy(stall_s=3.0)
    url = f"{s3_bucket}/runs/cancel/step-1"
    ckptfmt.save({"w": torch.arange(80 * 1024, dtype=torch.int32)}, url, chunk_size=4096)  # 320 KiB: not packed
    with ckptfmt.open(url) as reader:
        chunks = [chunk.hash for chunk in reader.manifest.chunks]
    assert len(chunks) == 80
    for held in chunks[4:20]:  # verify reads chunks in table order, 16 at a time
        proxy.script("stall", op="GET", key_suffix=held, forward=True)
    options = {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"read_timeout": 30}}
    app = create_app([url], storage_options=options)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("v")
        verifying = app.screen
        assert isinstance(verifying, VerifyScreen)
        deadline = time.monotonic() + 60
        while verifying.counter.value < 4 * 4096:  # the 4 chunks before the held ones
            assert time.monotonic() < deadline and verifying.report is None, verifying.report
            await pilot.pause(0.01)
        await pilot.press("escape")
        await settle(app, pilot)
        report = verifying.report
        assert report is not None and report.cancelled and not report.ok
        assert report.chunks_checked == 20 and report.problems == []  # 4, then the 16 held: 60 never read
        assert proxy.injected()[("stall", "GET")] == 16
        assert "CANCELLED after 1 checkpoint(s), 20 chunks" in text_of(app, "#result")
        assert app.verified == {} and all(worker.is_finished for worker in app.workers)


@async_test
async def test_stats_of_damaged_tensor_shows_error(repo):
    damage_chunk_of(repo, "model/new.weight")
    app = create_app([f"{repo}/step-2"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        tree = app.screen.query_one(TensorTree)
        tree.move_cursor(find_node(tree, "model/new.weight"))
        await pilot.press("enter")
        await settle(app, pilot)
        assert "Error:" in text_of(app, "ErrorPanel") and "hash" in text_of(app, "ErrorPanel")
        assert "computing" not in text_of(app, "#stats")
        assert any(n.severity == "error" for n in app._notifications)
        assert isinstance(app.screen, CheckpointScreen)  # still running, still usable


@async_test
async def test_diff_from_repository_marks(repo):
    app = create_app([repo])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("d")  # nothing marked yet: a warning, no diff
        assert isinstance(app.screen, RepositoryScreen)
        await pilot.press("space", "up", "space", "d")  # the cursor starts on the newest, step-2
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, DiffScreen)
        assert screen.a.endswith("step-1") and screen.b.endswith("step-2")
        assert "2 changed, 1 added, 0 removed, 3 unchanged" in text_of(app, "#summary")


@async_test
async def test_diff_of_two_targets(repo):
    app = create_app([f"{repo}/step-1", f"{repo}/step-2"])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, DiffScreen)
        rows = cells(screen.query_one("#tensor-diff"))
        assert [r[:2] for r in rows[:3]] == [
            ["model/layers.0.attn.q_proj.weight", "changed"],  # moved most, listed first
            ["model/layers.1.attn.q_proj.weight", "changed"],
            ["model/new.weight", "added"],
        ]
        assert rows[0][4] == "1" and rows[0][6] == "100.0%"
        assert rows[1][6] == "6.2%"  # 1 of 16 elements
        assert {r[1] for r in rows[3:]} == {"unchanged"}
        fields = {r[0]: r[1:] for r in cells(screen.query_one("#metadata-diff"))}
        assert fields["user.note"] == ["first", "second"]
        assert fields["step"] == ["1", "2"]


@async_test
async def test_missing_checkpoint_shows_error(tmp_path):
    app = create_app([str(tmp_path / "no[b]where" / "step-9")])  # [b]: shown as text, not markup
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = text_of(app, "ErrorPanel")
        assert "Error:" in panel and "not a ckptfmt repository or checkpoint" in panel and "no[b]where" in panel
        assert any(n.severity == "error" for n in app._notifications)
        await pilot.press("question_mark")
        assert "Quit" in text_of(app, "#help-keys") and "compares two" in text_of(app, "#help-text")
        await pilot.press("escape")
        await pilot.press("q")
    assert app.return_code == 0


@async_test
async def test_no_credentials_shows_error(monkeypatch, tmp_path):
    """S3 without credentials: botocore's message in the UI (nothing listens on the endpoint)."""
    pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "skip_instance_cache": True,
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    app = create_app(["s3://no-such-bucket/run"], storage_options=options)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "Unable to locate credentials" in text_of(app, "ErrorPanel")


def test_main_rejects_three_targets(capsys):
    from ckptfmt.tui import main

    assert main(["a", "b", "c"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # an error goes to stderr, on one line
    assert captured.err.startswith("ckptfmt tui: error: ") and "two to compare" in captured.err
    assert captured.err.count("\n") == 1


def _app_on_many_tensors(tmp_path, count: int):
    """The TUI on a checkpoint of ``count`` small tensors grouped in layers of 10."""
    state = {"model": {f"layers.{i // 10}.block.{i % 10}.weight": torch.full((2,), float(i)) for i in range(count)}}
    url = str(tmp_path / f"run-{count}" / "step-0")
    ckptfmt.save(state, url, step=0)
    return create_app([url])


@async_test
async def test_opening_many_tensors_scales_linearly_and_builds_the_tree_lazily(tmp_path):
    """Opening 5,000 tensors costs at most ~2x per tensor what opening 500 does (a tree built eagerly,
    or a quadratic pass, costs 10x per tensor more), and builds only the rows the screen shows.

    CPU time, not wall time, and a ratio within one test, not a fixed bound: tests running beside
    this one on a loaded machine change neither."""
    cpu = {}
    for count in (500, 5000):
        app = _app_on_many_tensors(tmp_path, count)
        async with app.run_test(size=SIZE) as pilot:
            cpu_started = time.process_time()
            while not isinstance(app.screen, CheckpointScreen):
                await pilot.pause(0.01)
                assert time.process_time() - cpu_started < 120, f"opening {count} tensors did not finish"
            await pilot.pause()
            cpu[count] = time.process_time() - cpu_started
            if count < 5000:
                continue
            tree = app.screen.query_one(TensorTree)
            layers = tree.root.children[0].children[0]  # model > layers: single groups, opened
            assert layers.data.count == 5000 and len(layers.children) == 500
            first = layers.children[0]
            assert first.data.count == 10 and not first.children  # not built until expanded
            first.expand()
            await pilot.pause()
            assert len(first.children) == 1 and first.children[0].data.name == "block"
    assert cpu[5000] < 20 * cpu[500], f"CPU to open 500 tensors: {cpu[500]:.2f} s, 5,000: {cpu[5000]:.2f} s"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_smoke_in_tmux(repo, tmp_path):
    """Drive the real `ckptfmt tui` in an 80x24 terminal: the repository with the whole footer; Enter and ]
    sent at once open the newest checkpoint on its Environment tab; back, v verifies the repository, Enter
    goes back; q quits."""
    session = f"ckptfmt-tui-{os.getpid()}"
    command = f"{shlex.quote(sys.executable)} -m ckptfmt.cli tui {shlex.quote(str(repo))}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", command], check=True)
    try:
        assert wait_for_screen(session, "? Help"), capture(session)  # the footer is drawn last
        screen = capture(session)
        assert "step-1" in screen and "step-2" in screen and "not verified" in screen
        assert "q Quit" in screen.splitlines()[-1] and "? Help" in screen.splitlines()[-1], screen
        send_keys(session, "Enter", "]")
        assert wait_for_screen(session, torch.__version__), capture(session)  # on the Environment tab
        assert "step 2" in capture(session)  # of the newest checkpoint (its summary: "step 2  2026-...")
        send_keys(session, "Escape")  # alone: a terminal sends Escape and v at once as Alt+v
        assert wait_for_screen(session, "not verified"), capture(session)
        send_keys(session, "v")
        assert wait_for_screen(session, "OK: 2 checkpoint(s)"), capture(session)
        send_keys(session, "Enter")
        assert wait_for_screen(session, "not verified", present=False), capture(session)
        send_keys(session, "q")
        deadline = time.monotonic() + 30  # as long as wait_for_screen allows: a hang guard, not a bound
        while time.monotonic() < deadline and session_alive(session):
            time.sleep(0.1)
        assert not session_alive(session), capture(session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, check=False)


def send_keys(session: str, *keys: str) -> None:
    """Type ``keys`` in one go, as fast as a terminal delivers them."""
    subprocess.run(["tmux", "send-keys", "-t", session, *keys], check=True)


def capture(session: str) -> str:
    return subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=False
    ).stdout


def session_alive(session: str) -> bool:
    return subprocess.run(["tmux", "has-session", "-t", session], capture_output=True, check=False).returncode == 0


def wait_for_screen(session: str, text: str, timeout: float = 30.0, present: bool = True) -> bool:
    """Whether ``text`` shows (or, with ``present=False``, has gone) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (text in capture(session)) is present:
            return True
        time.sleep(0.2)
    return False


# -- snapshots ---------------------------------------------------------------------------------------------
# Deterministic screens: fixed seeds, a relative repository path (the app shows targets as given) and
# a frozen clock while saving (tests/tui/conftest.py). Update with: pytest tests/tui/test_tui.py --snapshot-update

SNAP_SIZE = (120, 34)


@snapshot
def test_snapshot_repository(fixed_repo, snap_compare):
    assert snap_compare(create_app([fixed_repo]), terminal_size=SNAP_SIZE, run_before=pressing("space"))


@snapshot
def test_snapshot_checkpoint_statistics(fixed_repo, snap_compare):
    app = create_app([f"{fixed_repo}/step-1"])
    assert snap_compare(app, terminal_size=SNAP_SIZE, run_before=pressing("down", "down", "down", "enter"))


@snapshot
def test_snapshot_diff(fixed_repo, snap_compare):
    app = create_app([f"{fixed_repo}/step-1", f"{fixed_repo}/step-2"])
    assert snap_compare(app, terminal_size=SNAP_SIZE, run_before=pressing())


@snapshot
def test_snapshot_missing_checkpoint(fixed_repo, snap_compare):
    app = create_app([f"{fixed_repo}/step-9"])
    assert snap_compare(app, terminal_size=SNAP_SIZE, run_before=pressing())


@async_test
async def test_on_the_s3_test_server(s3_bucket):
    """The same screens on S3 (moto's server on loopback): list, open, statistics, verify, diff."""
    url = f"{s3_bucket}/runs/exp"
    ckptfmt.save(model_state(1), f"{url}/step-1", step=1)
    state = model_state(1)
    state["model"]["head.bias"] = torch.zeros(4)
    ckptfmt.save(state, f"{url}/step-2", step=2)
    app = create_app([url])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, RepositoryScreen)
        assert [r[1] for r in cells(screen.query_one("#checkpoints"))] == ["step-1", "step-2"]
        await pilot.press("v")
        await settle(app, pilot)
        assert isinstance(app.screen, VerifyScreen) and app.screen.report.ok
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("enter")
        await settle(app, pilot)
        checkpoint = app.screen
        assert isinstance(checkpoint, CheckpointScreen) and checkpoint.reader.url.startswith("s3://")
        tree = checkpoint.query_one(TensorTree)
        bias = next(node for node in tree.root.children[0].children if node.data.name == "head").children[0]
        tree.move_cursor(bias)
        await pilot.press("enter")
        await settle(app, pilot)
        assert "statistics of 4 values" in text_of(app, "#stats")
    diff_app = create_app([f"{url}/step-1", f"{url}/step-2"])
    async with diff_app.run_test(size=SIZE) as pilot:
        await settle(diff_app, pilot)
        assert isinstance(diff_app.screen, DiffScreen)
        rows = cells(diff_app.screen.query_one("#tensor-diff"))
        assert rows[0][0] == "model/head.bias" and rows[0][1] == "changed"


def test_statistics_kept_as_rows_of_columns_show_as_their_dicts_do():
    """A save's own manifest holds small tensors' statistics as ``StatsRow``s (a mapping, not a dict): the
    detail pane and the NaN/Inf marks read them as the maps a parsed manifest holds."""
    import numpy as np

    from ckptfmt.format.tensor_stats import StatsRow
    from ckptfmt.tui.screens.checkpoint import recorded_stats_rows
    from ckptfmt.tui.widgets.tensor_tree import non_finite_count

    columns = {"count": np.array([8, 4]), "min": np.array([-1.0, 0.5]), "max": np.array([2.0, 3.0]),
               "nan": np.array([0, 2]), "posinf": np.array([0, 1]), "neginf": np.array([0, 0]),
               "zeros": np.array([1, 0])}
    for at in (0, 1):
        row = StatsRow(columns, at)
        assert recorded_stats_rows(row) == recorded_stats_rows(dict(row)) != [("statistics", "not recorded")]
        assert non_finite_count(row) == non_finite_count(dict(row)) == (0, 3)[at]
