"""The C kernels and key checks built with AddressSanitizer and UndefinedBehaviorSanitizer (issue 49): their
tests run against that build, any out-of-bounds read, overflow or undefined shift failing them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.helpers import needs_tool

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("c_kernels", "c_keys")
#: Loads the sanitized builds as ckptfmt.kernels' modules before ckptfmt does, then runs their tests.
DRIVER = """
import importlib.util, sys
built = {}
for name, path in zip(("c_kernels", "c_keys"), sys.argv[1:]):
    spec = importlib.util.spec_from_file_location(f"ckptfmt.kernels.{name}", path)
    built[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built[name])
    sys.modules[spec.name] = built[name]
import pytest
from ckptfmt import kernels
from ckptfmt.kernels import keys
assert kernels._native is built["c_kernels"] and keys._native is built["c_keys"], (kernels._native, keys._native)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py", "tests/kernels/test_keys.py"]))
"""


COMPILER = shutil.which("gcc")


@pytest.mark.exhaustive  # a build of its own and a slow run: make test runs the kernels as built
@needs_tool(COMPILER, "gcc builds the sanitized kernels")
def test_the_kernels_pass_their_tests_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    compiler = str(COMPILER)
    built = [tmp_path / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}" for name in MODULES]
    for name, path in zip(MODULES, built):
        subprocess.run([compiler, "-O1", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off",
                        "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-shared", "-fPIC",
                        f"-I{sysconfig.get_paths()['include']}", str(ROOT / "ckptfmt" / "kernels" / f"{name}.c"),
                        "-o", str(path)], check=True)
    runtime = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True,
                             check=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0",  # Python's own allocations live on
               UBSAN_OPTIONS="print_stacktrace=1")
    result = subprocess.run([sys.executable, "-c", DRIVER, *map(str, built)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert " passed" in result.stdout and "runtime error" not in result.stderr, result.stderr[-3000:]
