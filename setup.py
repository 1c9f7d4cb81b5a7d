"""Build of the optional C kernel library (csrc/) only; everything else is in pyproject.toml.

The library is plain C (no Python or torch headers) loaded through ctypes by bitnetlm.kernels.cpu.
It is marked optional: without a C compiler the install still succeeds and bitnetlm falls back to the
pure-torch reference backend.
"""

import glob
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

UNIX_FLAGS = ["-O3", "-std=c11", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-Wall"]


class BuildKernels(build_ext):
    def build_extensions(self):
        for ext in self.extensions:
            if self.compiler.compiler_type == "msvc":
                ext.extra_compile_args = ["/O2"]
            else:
                ext.extra_compile_args = list(UNIX_FLAGS)
                ext.extra_link_args = ["-pthread"]
        super().build_extensions()

    def get_export_symbols(self, ext):
        return []  # a ctypes library, not a Python module: no PyInit_ symbol


sources = sorted(glob.glob("csrc/*.c"))
ext = Extension(
    "bitnetlm.kernels._bitnet_cpu",
    sources=sources,
    include_dirs=["csrc"],
    depends=glob.glob("csrc/*.h"),
    optional=True,
)

setup(
    ext_modules=[ext] if platform.python_implementation() == "CPython" else [],
    cmdclass={"build_ext": BuildKernels},
)
