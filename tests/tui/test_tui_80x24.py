"""The TUI at 80x24, the size of many terminals: every screen fits it (Pilot tests reading the screen as the
user sees it, and snapshots), keys typed right after a screen switch reach the new screen, the newest
checkpoint starts under the cursor, and the diff shows the plain values that differ, as ``ckptfmt diff`` does.

The GPT-2 checkpoints (tests/tui/states.py) have a GPT-2's tensor keys, up to 40 characters long.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("textual")

import ckptfmt
from ckptfmt.tools.diff import diff
from ckptfmt.tui import create_app
from ckptfmt.tui.screens.checkpoint import CheckpointScreen
from ckptfmt.tui.screens.diff import DiffScreen
from ckptfmt.tui.screens.repository import RepositoryScreen
from ckptfmt.tui.screens.run import RunScreen
from ckptfmt.tui.screens.verify import VerifyScreen
from ckptfmt.tui.widgets.tensor_tree import TensorTree
from tests.support.tui_driving import async_test, cells, settle
from tests.tui.terminal import SMALL, find_node, pressing, region_lines, screen_lines, snapshot, type_ahead

GPT2_KEY = "model/transformer.h.11.mlp.c_proj.weight"  # the tensor that moved most between step-100 and 200


async def settled(app, pilot) -> None:
    """Wait until keys typed ahead have all been handled (each may open a screen, which holds the next keys
    until it is drawn) and the workers they started are done."""
    for _ in range(4):
        await settle(app, pilot)


@async_test
async def test_the_footer_keeps_quit_and_help_on_every_screen(repo):
    app = create_app([repo])
    footers = {}
    async with app.run_test(size=SMALL) as pilot:
        for name, keys in (("repository", ()), ("checkpoint", ("enter",)), ("run", ("escape", "a")),
                           ("diff", ("escape", "space", "up", "space", "d")), ("verify", ("escape", "v"))):
            await pilot.press(*keys)
            await settled(app, pilot)
            footers[name] = screen_lines(app)[-1]
    for name, footer in footers.items():
        assert "q Quit" in footer and "? Help" in footer, (name, footer)
    assert "esc Back" in footers["checkpoint"] and "esc Back" not in footers["repository"]  # only where it goes back


@async_test
async def test_tree_rows_cut_at_the_edge_end_in_an_ellipsis(gpt2_repo):
    app = create_app([f"{gpt2_repo}/step-100"])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        tree = app.screen.query_one(TensorTree)
        rows = region_lines(app, tree)
        cut = 0
        for line, row in enumerate(rows, start=tree.scroll_offset.y):
            node = tree.get_node_at_line(line)
            assert node.data.name in row, row
            if node.label.plain not in row:
                assert row.endswith("…"), row
                cut += 1
        assert cut > len(rows) // 2  # the deep rows of a GPT-2 do not fit half of 80 columns


@async_test
async def test_the_detail_pane_breaks_keys_between_names_and_shows_the_histogram(gpt2_repo):
    key = "model/transformer.h.0.attn.c_attn.weight"
    app = create_app([f"{gpt2_repo}/step-100"])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        tree = app.screen.query_one(TensorTree)
        tree.move_cursor(find_node(tree, key))
        await pilot.pause()
        pane = app.screen.query_one("#detail-pane")
        lines = region_lines(app, pane)
        wrapped = lines[:next(i for i, line in enumerate(lines) if line.startswith("dtype"))]
        assert len(wrapped) > 1 and "".join(wrapped) == key, lines  # too long for the pane, and whole
        assert all(line.endswith(("/", ".")) for line in wrapped[:-1]), wrapped  # broken only after a separator
        await pilot.press("enter")
        await settle(app, pilot)
        lines = region_lines(app, pane)
        assert "statistics of 16 values" in lines, lines
        bins = [line for line in lines if line.startswith("[")]
        assert len(bins) == 12, lines  # the whole histogram on screen


@async_test
async def test_the_diff_of_gpt2_keys_fits_and_keeps_the_keys_when_scrolled_right(gpt2_repo):
    app = create_app([f"{gpt2_repo}/step-100", f"{gpt2_repo}/step-200"])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        table = app.screen.query_one("#tensor-diff")
        header, first, *rows = region_lines(app, table)
        assert header.split() == ["key", "status", "dtype", "shape", "max", "|diff|"], header
        assert first.split() == ["model/…h.11.mlp.c_proj.weight", "changed", "float32", "(4,", "4)", "1"], first
        assert all(row.split()[0].endswith(("weight", "bias")) for row in rows)  # each key keeps its own name
        assert GPT2_KEY in screen_lines(app)[-2]  # the whole key of the row under the cursor, below the table
        table.scroll_to(x=table.max_scroll_x, animate=False)
        await pilot.pause()
        header, first, *_ = region_lines(app, table)
        assert header.split()[0] == "key" and header.split()[-2:] == ["L2", "changed"], header
        assert first.startswith(" model/…h.11.mlp.c_proj.weight") and first.endswith("100.0%"), first
        await pilot.resize_terminal(160, 45)
        await pilot.pause()
        assert cells(table)[0][0] == GPT2_KEY  # room enough: keys whole again


@async_test
async def test_the_diff_shows_the_plain_values_that_differ_as_the_cli_does(gpt2_repo):
    a, b = f"{gpt2_repo}/step-100", f"{gpt2_repo}/step-200"
    assert [key for key, _, _ in diff(a, b).values] == ["optimizer/param_groups/0/lr"]  # what ckptfmt diff lists
    app = create_app([a, b])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        assert "1 value and 1 metadata field differ" in " ".join(screen_lines(app)[1:4])
        await pilot.press("right_square_bracket")
        assert app.screen.query_one("#tabs").active == "values"
        assert cells(app.screen.query_one("#value-diff")) == [["optimizer/param_groups/0/lr", "0.0003", "0.0001"]]
        assert "optimizer/param_groups/0/lr  0.0003  0.0001" in "\n".join(screen_lines(app))


@async_test
async def test_an_intact_verify_shows_no_problem_table_and_enter_goes_back(repo):
    app = create_app([repo])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("v")
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, VerifyScreen) and screen.report.ok
        assert not screen.query_one("#problems").display
        assert not any("problem" in line for line in screen_lines(app)), screen_lines(app)
        await pilot.press("enter")
        assert isinstance(app.screen, RepositoryScreen)
        assert {row[1]: row[6] for row in cells(app.screen.query_one("#checkpoints"))} == {"step-1": "ok",
                                                                                          "step-2": "ok"}


@async_test
async def test_the_newest_checkpoint_is_under_the_cursor_and_on_screen(tmp_path):
    """Oldest first, as ckptfmt ls lists them, with the cursor on the newest: Enter opens the latest state."""
    url = str(tmp_path / "many")
    for step in range(30):
        ckptfmt.save({"w": torch.full((2,), float(step))}, f"{url}/step-{step:02d}", step=step)
    app = create_app([url])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        table = app.screen.query_one("#checkpoints")
        assert table.cursor_row == 29 and cells(table)[29][1] == "step-29"
        assert any(line.lstrip().startswith("step-29") for line in screen_lines(app))
        await pilot.press("enter")
        await settle(app, pilot)
        assert isinstance(app.screen, CheckpointScreen) and app.screen.reader.name == "step-29"


@async_test
async def test_keys_typed_right_after_a_screen_switch_reach_the_new_screen(repo):
    """Keys sent at once, as a terminal delivers fast typing: each reaches the screen the previous key opened."""
    app = create_app([repo])
    async with app.run_test(size=SMALL) as pilot:
        type_ahead(app, "enter", "right_square_bracket")  # before the repository is even listed
        await settled(app, pilot)
        assert isinstance(app.screen, CheckpointScreen) and app.screen.reader.name == "step-2"
        assert app.screen.query_one("#tabs").active == "environment"
        type_ahead(app, "escape", "up", "enter")
        await settled(app, pilot)
        assert isinstance(app.screen, CheckpointScreen) and app.screen.reader.name == "step-1"
        type_ahead(app, "escape", "space", "down", "space", "d", "right_square_bracket")
        await settled(app, pilot)
        assert isinstance(app.screen, DiffScreen) and app.screen.query_one("#tabs").active == "values"
        type_ahead(app, "escape", "v")
        await settled(app, pilot)  # Enter leaves a verify once it has ended (on a busy machine, later than drawn)
        assert isinstance(app.screen, VerifyScreen) and app.screen.report is not None
        type_ahead(app, "enter", "a")
        await settled(app, pilot)
        assert isinstance(app.screen, RunScreen)


@async_test
async def test_the_help_shows_brackets_as_text(repo):
    app = create_app([f"{repo}/step-1"])
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        assert "[ and ] switch between" in "\n".join(screen_lines(app))


# -- snapshots at 80x24 ------------------------------------------------------------------------------------
# Update with: pytest tests/tui/test_tui_80x24.py --snapshot-update

@snapshot
def test_snapshot_repository(fixed_repo, snap_compare):
    assert snap_compare(create_app([fixed_repo]), terminal_size=SMALL, run_before=pressing())


@snapshot
def test_snapshot_checkpoint_statistics(gpt2_repo, snap_compare):
    """A GPT-2 tensor six groups deep (model > transformer > h > 0 > attn > c_attn > weight), read."""
    app = create_app([f"{gpt2_repo}/step-100"])
    assert snap_compare(app, terminal_size=SMALL, run_before=pressing(*["down"] * 14, "enter"))


@snapshot
def test_snapshot_diff(gpt2_repo, snap_compare):
    app = create_app([f"{gpt2_repo}/step-100", f"{gpt2_repo}/step-200"])
    assert snap_compare(app, terminal_size=SMALL, run_before=pressing())


@snapshot
def test_snapshot_diff_values(gpt2_repo, snap_compare):
    app = create_app([f"{gpt2_repo}/step-100", f"{gpt2_repo}/step-200"])
    assert snap_compare(app, terminal_size=SMALL, run_before=pressing("right_square_bracket"))


@snapshot
def test_snapshot_help(fixed_repo, snap_compare):
    app = create_app([f"{fixed_repo}/step-1"])
    assert snap_compare(app, terminal_size=SMALL, run_before=pressing("question_mark"))


@snapshot
def test_snapshot_run_steps(steady_run, snap_compare):
    assert snap_compare(create_app([steady_run]), terminal_size=SMALL, run_before=pressing("a"))


@snapshot
def test_snapshot_run_saves(steady_run, snap_compare):
    app = create_app([steady_run])
    assert snap_compare(app, terminal_size=SMALL, run_before=pressing("a", "right_square_bracket"))
