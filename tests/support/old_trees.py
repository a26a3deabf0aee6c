"""Past commits of this repository as runnable trees, for tests across format versions.

``tree(commit)`` unpacks a commit (``git archive``) into a cache folder once, keyed by the full commit
hash; two processes asking at once each unpack into a folder of their own and one rename wins.
``run_in_tree(commit, program, *args)`` runs a Python program with that tree's ``ckptfmt`` (this
venv's interpreter, the tree alone on PYTHONPATH) and returns the JSON it prints. The program never
sees today's ckptfmt: the editable install's import hook is taken out before it runs, and the
current folder is not on its path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: The repository whose history the trees come from.
ROOT = Path(__file__).resolve().parents[2]
#: Where trees are unpacked (``CKPTFMT_OLD_TREES`` moves it): outside the checkout, shared by sessions.
CACHE = Path(os.environ.get("CKPTFMT_OLD_TREES") or Path(tempfile.gettempdir()) / f"ckptfmt-old-trees-{os.getuid()}")

# Run before the program: drop the editable install's finder (it maps ckptfmt submodules missing from an
# old tree to today's code), check which ckptfmt will be imported, then run the program as __main__.
_BOOT = """
import importlib.util, runpy, sys
tree, kind, program, *args = sys.argv[1:]
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
origin = importlib.util.find_spec("ckptfmt").origin
if not origin.startswith(tree + "/"):
    sys.exit(f"ckptfmt would come from {origin}, not from {tree}")
sys.argv = [program, *args]
if kind == "script":
    sys.path.append(program.rpartition("/")[0])  # its own folder, after the tree
    runpy.run_path(program, run_name="__main__")
else:
    exec(compile(program, "<program>", "exec"), {"__name__": "__main__"})
"""


class OldTreeError(RuntimeError):
    """A program run in an old tree failed (its stderr is in the message) or printed no JSON."""


def full_hash(commit: str) -> str:
    """The full hash of ``commit`` (any name git knows)."""
    result = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise OldTreeError(f"{commit}: not a commit of {ROOT} (a shallow clone lacks old commits)")
    return result.stdout.strip()


def tree(commit: str, cache: Path | None = None) -> Path:
    """The files of ``commit``, unpacked once into ``cache`` (default ``CACHE``) and shared after."""
    sha = full_hash(commit)
    folder = (cache or CACHE) / sha
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    unpacking = Path(tempfile.mkdtemp(prefix=f".{sha}-", dir=folder.parent))
    try:
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(unpacking)], input=archive.stdout, capture_output=True, check=True)
        os.rename(unpacking, folder)
    except OSError:
        if not folder.is_dir():  # not the loss of a race to another process
            raise
    finally:
        shutil.rmtree(unpacking, ignore_errors=True)
    return folder


def run_in_tree(commit: str, program: str | Path, *args: str, timeout: float = 120, cwd: Path | None = None,
                cache: Path | None = None) -> Any:
    """Run ``program`` (a ``Path``: a script; a ``str``: Python code) with ``args`` under ``commit``'s
    ckptfmt, and return the JSON it printed to stdout. A script's own folder is on its path, after the
    tree. Raises OldTreeError with the program's stderr if it fails or runs past ``timeout`` seconds."""
    root = tree(commit, cache)
    kind, text = ("script", str(Path(program).resolve())) if isinstance(program, Path) else ("code", program)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-P", "-c", _BOOT, str(root), kind, text, *map(str, args)]
    try:
        result = subprocess.run(command, cwd=cwd or root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise OldTreeError(f"{commit}: still running after {timeout} s\n{_text(exc.stderr)[-4000:]}") from None
    if result.returncode != 0:
        raise OldTreeError(f"{commit}: exit {result.returncode}\n{result.stderr[-6000:]}")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        raise OldTreeError(f"{commit}: printed no JSON: {result.stdout[-2000:]!r}\n{result.stderr[-2000:]}") from None


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""
