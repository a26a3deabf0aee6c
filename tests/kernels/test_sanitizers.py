"""The C kernels built with AddressSanitizer and UndefinedBehaviorSanitizer (issue 49 part 1): the kernel
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
SOURCE = ROOT / "ckptfmt" / "kernels" / "c_kernels.c"
#: Loads the sanitized build as ckptfmt.kernels.c_kernels before ckptfmt does, then runs the kernel tests.
DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ckptfmt.kernels.c_kernels", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules[spec.name] = module
import pytest
from ckptfmt import kernels
assert kernels._native is module, kernels._native
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py"]))
"""


COMPILER = shutil.which("gcc")


@pytest.mark.exhaustive  # a build of its own and a slow run: make test runs the kernels as built
@needs_tool(COMPILER, "gcc builds the sanitized kernels")
def test_the_kernels_pass_their_tests_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    compiler = str(COMPILER)
    built = tmp_path / f"c_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([compiler, "-O1", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off",
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-shared", "-fPIC",
                    f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(built)], check=True)
    runtime = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True,
                             check=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0",  # Python's own allocations live on
               UBSAN_OPTIONS="print_stacktrace=1")
    result = subprocess.run([sys.executable, "-c", DRIVER, str(built)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert " passed" in result.stdout and "runtime error" not in result.stderr, result.stderr[-3000:]
