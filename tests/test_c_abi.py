"""The C library is the C99 the README promises: its header alone, and every source it is built from.

The C program that trains through the installed package is in `test_install.py`.
"""
import glob
import os
import shutil
import subprocess

import pytest
import scipy_openblas32

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEADER_DIR = os.path.join(ROOT, "libuform", "include")
SOURCES = sorted(glob.glob(os.path.join(ROOT, "libuform", "src", "*.c")) +
                 glob.glob(os.path.join(ROOT, "libuform", "src", "ram", "*.c")))

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_header_alone_is_c99(tmp_path):
    unit = tmp_path / "unit.c"
    unit.write_text("#include <uform.h>\nint main(void) { return uform_version()[0] == '\\0'; }\n")
    subprocess.run(["cc", "-std=c99", "-pedantic-errors", "-Wall", "-Werror", "-fsyntax-only", "-I", HEADER_DIR,
                    str(unit)], check=True)


@pytest.mark.parametrize("source", SOURCES, ids=lambda source: os.path.relpath(source, ROOT))
def test_library_source_is_c99(source):
    """With the build's dialect: C99 and POSIX 2008, nothing of C11 or GNU's."""
    result = subprocess.run(["cc", "-std=c99", "-D_POSIX_C_SOURCE=200809L", "-pedantic-errors", "-fopenmp",
                             "-fsyntax-only", "-I", HEADER_DIR, "-I", os.path.join(ROOT, "libuform", "src"),
                             "-I", scipy_openblas32.get_include_dir(), source], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
