"""Writes tests/corpus/v<VERSION>/: a repository of checkpoints saved by the ckptfmt that introduced that
format version (the commit's tree, unpacked with ``git archive``), and expected.json, what that writer
says it saved (tests/corpus/README.md).

    .venv/bin/python tests/corpus/generate.py            # every version that has no folder yet
    .venv/bin/python tests/corpus/generate.py 1.5 1.6    # these versions again (their folders replaced)

Adding a version is one line of VERSIONS, then the first command. A version's folder is never written
by any other commit's code: regenerating one runs its own commit again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # run as a script: the repository root, for tests.support
    sys.path.insert(1, str(HERE.parents[1]))

from tests.support.old_trees import run_in_tree

#: Format version -> the commit whose ckptfmt writes its corpus: the commit that introduced the version.
VERSIONS = {
    "1.0": "8b5bed2ab6c37934c2829d8963356f2bd10392c6",
    "1.1": "d263008bd6cfa46c9ba7bd0ae4fbb8d83ede8292",
    "1.2": "c083073ebf372c66554c9dc22e770cc8d9009389",
    "1.3": "f43ded742681de3e25d22322bc4ca511311092fa",
    "1.4": "187b1d7f7794584deaee151cd178bd7b6306ddd6",
    "1.5": "3eecb765e9d078c1557f62f7bd13d3cba9b5aa41",
    "1.6": "0ee299c7a61976bb0d877caf6813c2a5931a0ecd",
    "1.7": "4cb434b3ad9780f96b50d7fdfc7e16b99c8dcc81",
    "1.8": "da84164174db9fcf710e181bfc6148e6de1c5b6e",
    "1.9": "d68b45c4190ab6fdf985c4bcd561607385f98c5d",
    "1.10": "64ab5bfb43163cb9a46e6e5de076b2c9e020d3fb",
    "1.11": "5a7b667f63eed7fc7ff570425bdf8c77f6549ebc",
    "1.12": "f5a8a832277994ad17adb1527d7be299b74d1c0c",
    "1.13": "db32f5cdcd7229546e0b89b7cc3f79b9c73bc50e",
    "1.14": "a354416b3eb52a3394e745524fc7bfe30f969274",
    "1.15": "131ce17eb9e5bf63d460eff6f7b9ae444141e859",
    "2.0": "654017651623efc92ce23b8be83c8d5150ea4e1b",
    "2.1": "753ec7812a0f7bbedffc58eef8755a5ab040a803",
}
WRITER = HERE / "writer.py"
#: The test key the writers of 1.7 on sign with (made by the first of them to need it).
KEY = HERE / "keys" / "corpus-test-key.pem"


def folder(version: str) -> Path:
    """Where ``version``'s repository and expected.json are."""
    return HERE / f"v{version}"


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by path relative to it."""
    return {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def collective(commit: str, version: str, repo: Path, scratch: Path, world: int) -> dict:
    """The collective saves: ``world`` ranks of the writer at once, meeting in a file store."""
    store = scratch / "store"
    with ThreadPoolExecutor(world) as pool:
        runs = [pool.submit(run_in_tree, commit, WRITER, "rank", version, repo, store, rank, world, timeout=300)
                for rank in range(world)]
        return [run.result() for run in runs][0]["checkpoints"]


def drop_empty_folders(root: Path) -> None:
    """Remove the empty folders a writer left (git keeps none: a clone of the corpus has none)."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def generate(version: str) -> None:
    """Write ``version``'s folder: its commit's writer saves into a scratch repository (one process, then
    the ranks of the collective saves), which then replaces the folder, with expected.json."""
    commit = VERSIONS[version]
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch, "repo")
        solo = run_in_tree(commit, WRITER, "solo", version, repo, KEY, timeout=600)
        checkpoints = solo["checkpoints"]
        if solo["ranks"]:
            checkpoints.update(collective(commit, version, repo, Path(scratch), solo["ranks"]))
        drop_empty_folders(repo)
        expected = {"version": version, "commit": commit, "checkpoints": checkpoints, "files": file_hashes(repo)}
        target = folder(version)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(repo, target / "repo")
        (target / "expected.json").write_text(json.dumps(expected, separators=(",", ":")) + "\n")


def main(versions: list[str]) -> None:
    unknown = [v for v in versions if v not in VERSIONS]
    if unknown:
        raise SystemExit(f"unknown versions {unknown}: VERSIONS has {list(VERSIONS)}")
    for version in versions or [v for v in VERSIONS if not folder(v).exists()]:
        print(f"format {version}: {VERSIONS[version][:12]}", flush=True)
        generate(version)


if __name__ == "__main__":
    main(sys.argv[1:])
