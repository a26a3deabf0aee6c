"""tests/support/old_trees.py: a past commit is unpacked once, even by two processes at once, and a program run
in it imports that commit's ckptfmt, never today's. Needs the repository's history: a shallow clone skips
these tests, except under CI, where they fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.corpus.generate import VERSIONS
from tests.support.helpers import needs_tool
from tests.support.old_trees import ROOT, OldTreeError, full_hash, run_in_tree, tree

SHALLOW = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
pytestmark = needs_tool(SHALLOW.stdout.strip() == "false", "needs the repository's history (not a shallow clone)")

#: Writes format 1.8, with no ckptfmt/_teardown.py (added later), and imports no torch on ``import ckptfmt``.
COMMIT = VERSIONS["1.8"]
READ = """
import json, sys
import ckptfmt
from ckptfmt.format.version import FORMAT_VERSION
try:
    import ckptfmt._teardown
    later = True
except ImportError:
    later = False
print(json.dumps({"file": ckptfmt.__file__, "version": FORMAT_VERSION, "later_module": later, "args": sys.argv[1:]}))
"""


def test_a_program_runs_with_the_commits_ckptfmt_only(tmp_path):
    found = run_in_tree(COMMIT, READ, "a", "b", cache=tmp_path)
    assert found == {"file": str(tmp_path / full_hash(COMMIT) / "ckptfmt" / "__init__.py"), "version": [1, 8],
                     "later_module": False, "args": ["a", "b"]}


def test_a_script_runs_beside_its_own_folder(tmp_path):
    (tmp_path / "helper.py").write_text("NAME = 'helper'\n")
    (tmp_path / "script.py").write_text("import json, sys, helper\nprint(json.dumps([helper.NAME, sys.argv[1:]]))\n")
    assert run_in_tree(COMMIT, tmp_path / "script.py", 3, cache=tmp_path / "cache") == ["helper", ["3"]]


def test_a_failing_program_raises_with_its_stderr(tmp_path):
    with pytest.raises(OldTreeError, match="exit 1\nboom"):
        run_in_tree(COMMIT, "import sys; sys.exit('boom')", cache=tmp_path)
    with pytest.raises(OldTreeError, match="printed no JSON"):
        run_in_tree(COMMIT, "print('hello')", cache=tmp_path)
    with pytest.raises(OldTreeError, match="still running after 0.5 s"):
        run_in_tree(COMMIT, "import time; time.sleep(30)", timeout=0.5, cache=tmp_path)


def test_two_processes_unpack_a_commit_into_one_whole_folder(tmp_path):
    command = [sys.executable, "-c", "import sys; from pathlib import Path; from tests.support.old_trees import tree; "
               "print(tree(sys.argv[1], Path(sys.argv[2])))", COMMIT, str(tmp_path)]
    runs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    printed = {run.communicate(timeout=60)[0].strip() for run in runs}
    assert printed == {str(tree(COMMIT, tmp_path))}
    assert [p.name for p in tmp_path.iterdir()] == [full_hash(COMMIT)]  # no half-unpacked folder left
    assert "FORMAT_VERSION = (1, 8)" in (tmp_path / full_hash(COMMIT) / "ckptfmt" / "format" / "version.py").read_text()
