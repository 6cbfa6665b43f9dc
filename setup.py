"""Builds the Cython extension and `libuform.so` from the same C sources.

The CPU backend's matrix products call OpenBLAS from the `scipy-openblas32` wheel, which ships the
library and its `cblas.h` for exactly this use; the built objects find it at run time through an
rpath relative to the installed package.
"""
import glob
import os

import numpy
import scipy_openblas32
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sources = sorted(glob.glob("libuform/src/*.c") + glob.glob("libuform/src/ram/*.c"))
include_dirs = ["libuform/include", "libuform/src", scipy_openblas32.get_include_dir()]
openblas = dict(
    library_dirs=[scipy_openblas32.get_lib_dir()],
    libraries=[scipy_openblas32.get_library()],
    runtime_library_dirs=["$ORIGIN/../scipy_openblas32/lib", scipy_openblas32.get_lib_dir()],
)
sanitize = os.environ.get("UFORM_SANITIZE")  # e.g. "address,undefined" for a checked build
# uform builds from source where it runs, so it may use every vector unit of this CPU; set
# UFORM_MARCH=x86-64 (or another -march value) for a build that must run on other machines.
march = os.environ.get("UFORM_MARCH", "native")
compile_args = ["-O3", f"-march={march}", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
link_args = ["-fopenmp"]
if sanitize:
    # Every report is fatal: UBSan's checks stop the process rather than print and carry on.
    checked = [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all"]
    compile_args += ["-O1", "-g", "-fno-omit-frame-pointer"] + checked
    link_args += checked


class BuildExt(build_ext):
    """Names the plain C library `libuform.so`, not after the Python ABI."""

    def get_ext_filename(self, name):
        if name.split(".")[-1] == "libuform":  # asked with the full name or its last part alone
            return os.path.join(*name.split(".")[:-1], "libuform.so")
        return super().get_ext_filename(name)

    def get_export_symbols(self, ext):
        return [] if ext.name == "uform.libuform" else super().get_export_symbols(ext)


def extension(name, extra_sources=(), **kwargs):
    return Extension(name, list(extra_sources) + sources, include_dirs=include_dirs + kwargs.pop("include_dirs", []),
                     extra_compile_args=compile_args, extra_link_args=link_args, **openblas, **kwargs)


setup(
    ext_modules=cythonize(
        [
            extension("uform._native", ["uform/_native.pyx"], include_dirs=[numpy.get_include()]),
            extension("uform._testing", ["uform/_testing.pyx"], include_dirs=[numpy.get_include()]),
        ],
        compiler_directives=dict(language_level=3, boundscheck=False, wraparound=False),
    )
    + [extension("uform.libuform")],
    cmdclass=dict(build_ext=BuildExt),
    # A checked build keeps its objects apart, so neither build ever links the other's.
    options=dict(build=dict(build_base="build/sanitize")) if sanitize else {},
    package_data={"uform": ["*.pyx", "*.pxd", "include/*.h"]},
)
