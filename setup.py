"""Builds jaxspec's one native piece, the CPU small-T matmul kernel
(``jaxspec/kernels/cpu_matmul.cc``, ``docs/cpu_kernel.md``); everything else is in
pyproject.toml.

The kernel is an XLA FFI handler compiled against the headers jaxlib ships
(``jax.ffi.include_dir()``), so ``jaxlib`` is a build requirement. It is built as a plain shared
library (a setuptools ``Extension``, loaded with ``ctypes`` by ``jaxspec.kernels.cpu_matmul`` and
registered with ``jax.ffi.register_ffi_target``): the typed FFI needs no Python binding, so no
pybind11/nanobind dependency and nothing but a C++17 compiler. If the build fails, the install
still succeeds without it and jaxspec uses XLA's dot on CPU (with a warning at first use).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildKernel(build_ext):
    """Adds jaxlib's FFI include dir at build time; a failed compile is a warning, not an error."""

    def build_extensions(self):
        import jax.ffi  # a build requirement (pyproject.toml)

        for ext in self.extensions:
            ext.include_dirs.append(jax.ffi.include_dir())
        super().build_extensions()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - the kernel is optional: XLA's dot still works
            print(f"warning: jaxspec's CPU matmul kernel was not built ({exc}); jaxspec will use XLA's dot",
                  file=sys.stderr)

    def get_export_symbols(self, ext):
        return []  # a ctypes-loaded library, not a Python module: no PyInit_ symbol to export


kernel = Extension(
    "jaxspec.kernels._cpu_matmul",
    sources=["jaxspec/kernels/cpu_matmul.cc", "jaxspec/kernels/cpu_panels.cc", "jaxspec/kernels/cpu_attention.cc"],
    depends=["jaxspec/kernels/cpu_parallel.h"],
    language="c++",
    # -ffp-contract=off: the portable path's a + b * c stays unfused everywhere (row invariance);
    # the AVX2/FMA path is selected per function (target attribute) and at run time.
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility-inlines-hidden", "-w"],
)

setup(ext_modules=[kernel], cmdclass={"build_ext": BuildKernel})
