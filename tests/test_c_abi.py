"""A C program that includes only `uform.h` and links only `libuform.so` trains on the CPU."""
import os
import shutil
import subprocess

import pytest

import uform

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER_DIR = os.path.join(HERE, "..", "libuform", "include")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_program_trains_saves_and_resumes(tmp_path):
    library_dir = os.path.dirname(uform.__file__)
    assert os.path.exists(os.path.join(library_dir, "libuform.so"))
    program = str(tmp_path / "train")
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-pedantic", os.path.join(HERE, "c", "train.c"),
                    "-I", HEADER_DIR, "-L", library_dir, "-luform", f"-Wl,-rpath,{library_dir}", "-lm", "-o", program],
                   check=True)
    checkpoint = str(tmp_path / "c.safetensors")
    result = subprocess.run([program, checkpoint], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "trained 6 steps in C" in result.stdout
    assert os.path.getsize(checkpoint) > 0
