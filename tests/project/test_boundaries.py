"""Import boundaries: the core library never drags in the TUI, the converters, the S3 stack or Arrow
(only ckptfmt.analytics, an optional part, uses pyarrow)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ckptfmt

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ["textual", "ckptfmt.tui", "ckptfmt.converters", "s3fs", "boto3", "botocore", "aiobotocore", "pyarrow",
             "ckptfmt.analytics", "matplotlib", "ckptfmt.integrations", "lightning", "pytorch_lightning",
             "transformers", "accelerate", "torchtitan"]

PROBE = textwrap.dedent(
    """
    import importlib, json, pathlib, sys
    forbidden = {forbidden!r}

    def loaded():  # a submodule cannot be loaded without its package, so the roots suffice
        return sorted(f for f in forbidden if f in sys.modules)

    report = {{}}
    import ckptfmt
    report["ckptfmt"] = loaded()
    root = pathlib.Path(ckptfmt.__file__).parent  # listed from the files: walking packages would import them all
    modules = sorted(".".join(("ckptfmt", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
                     for path in root.rglob("*.py")
                     if path.relative_to(root).parts[0] not in ("cli", "analytics", "integrations")
                     and path.relative_to(root).as_posix() != "storage/s3.py")  # the S3 stack's own adapter
    report["modules"] = modules
    for name in modules:
        importlib.import_module(name)
        report[name] = loaded()

    # Local and in-memory use stays off the S3 stack too.
    import torch
    for url in (sys.argv[1] + "/repo", "memory://boundary-probe/repo"):
        ckptfmt.save({{"w": torch.ones(3)}}, url + "/a")
        ckptfmt.load(url)
        assert ckptfmt.verify(url).ok
    report["after local use"] = loaded()
    print(json.dumps(report))
    """
).format(forbidden=FORBIDDEN)


def test_core_imports_stay_lean(tmp_path):
    result = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    modules = report.pop("modules")
    # The probe really walked the package: the core modules are all there.
    assert {
        f"ckptfmt.{m}"
        for m in (
            "saving.save",
            "saving.core",
            "loading.reader",
            "repository.repository",
            "storage.local",
            "format.manifest",
            "format.values",
            "tools.verify",
            "format.layout",
            "saving.pipeline",
            "dcp",
        )
    } <= set(modules)
    assert set(report) == {"ckptfmt", "after local use", *modules}
    offenders = {where: mods for where, mods in report.items() if mods}
    assert offenders == {}, f"forbidden modules loaded: {offenders}"


def test_tui_and_converters_are_importable_subpackages():
    for name, folder in (("ckptfmt.tui", "tui"), ("ckptfmt.converters", "converters")):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve() == ROOT / folder / "__init__.py"
        assert module.__name__ == name
        assert module.__package__ == name
    assert Path(ckptfmt.__file__).resolve() == ROOT / "ckptfmt" / "__init__.py"


def test_every_package_directory_is_packaged():
    """pyproject's package list (with its package-dir mapping) covers every folder of code, so wheels are whole."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    assert found == listed


def _package_of(path: Path) -> list[str]:
    """The package a file's relative imports start from: converters/cli.py -> ckptfmt.converters."""
    mounted = {"converters": ["ckptfmt", "converters"], "tui": ["ckptfmt", "tui"]}
    parts = path.relative_to(ROOT).parts
    return mounted.get(parts[0], [parts[0]]) + list(parts[1:-1])


def _imports(path: Path) -> list[str]:
    """The absolute module names ``path`` imports, anywhere in it (lazy imports too)."""
    import ast

    package = _package_of(path)
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1])
            names += [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module)
    return names


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_dependencies_point_toward_the_core():
    """Statically, lazy imports included: the core (its CLI too) never imports the converters or the
    TUI, which join the CLI through entry points; neither of them imports the CLI."""
    offenders = []
    for path in _python_files("ckptfmt"):
        offenders += [(path.name, name) for name in _imports(path)
                      if name.split(".")[0] in ("tui", "converters")
                      or name.startswith(("ckptfmt.tui", "ckptfmt.converters"))]
    for path in _python_files("tui", "converters"):
        offenders += [(path.name, name) for name in _imports(path) if name.startswith("ckptfmt.cli")]
    assert offenders == []


def test_only_the_integrations_import_a_training_framework():
    """Lightning, transformers, accelerate and torchtitan are optional extras: outside
    ckptfmt/integrations/ nothing imports them, nor the integrations themselves."""
    frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan")
    offenders = []
    for path in _python_files("ckptfmt", "converters", "tui"):
        if path.is_relative_to(ROOT / "ckptfmt" / "integrations"):
            continue
        offenders += [(str(path.relative_to(ROOT)), name) for name in _imports(path)
                      if name.split(".")[0] in frameworks or name.startswith("ckptfmt.integrations")]
    assert offenders == []


def test_one_import_path_for_converters_and_tui():
    """Everything imports ckptfmt.converters / ckptfmt.tui, never top-level converters / tui packages,
    which would load a second copy of every module (two registries, two sets of classes)."""
    offenders = [(str(path.relative_to(ROOT)), name)
                 for path in _python_files("tests", "bench", "examples", "converters", "tui", "ckptfmt")
                 for name in _imports(path) if name and name.split(".")[0] in ("tui", "converters")]
    assert offenders == []


def test_the_cli_finds_the_commands_of_the_converters_and_the_tui():
    """export, import and tui come in through the ckptfmt.commands entry points of the installed package."""
    from ckptfmt.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert list(commands) == [
        "ls",
        "show",
        "verify",
        "diff",
        "analytics",
        "stragglers",
        "compare",
        "certify",
        "goodput",
        "report",
        "health",
        "rm",
        "gc",
        "repair",
        "protect",
        "sync",
        "keygen",
        "sign",
        "advise",
        "export",
        "import",
        "tui",
    ]
    assert commands["tui"].get_default("run").__module__ == "ckptfmt.tui.cli"
    assert commands["import"].get_default("run").__module__ == "ckptfmt.converters.cli"
