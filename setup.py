"""The C kernels (ckptfmt/kernels/c_kernels.c), built where a C compiler is: optional, so that an sdist
installs without one and runs the numpy kernels instead (ckptfmt --version says which). Everything
else about the package is in pyproject.toml."""

import sys

from setuptools import Extension, setup

#: No fused multiply-add: the kernels' sums must round as numpy's do (ckptfmt/kernels/__init__.py).
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off"]

setup(ext_modules=[Extension("ckptfmt.kernels.c_kernels", ["ckptfmt/kernels/c_kernels.c"], extra_compile_args=FLAGS,
                             optional=True)])
