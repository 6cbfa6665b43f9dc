"""The package under test as a C user and a packager meet it: one copy of the library, exporting only
its API, run paths free of the build's folders, and the header and flags a C program needs.

Each test reads the package `import uform` found: an install, or an in-place build in the checkout.
"""
import filecmp
import glob
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys

import pytest
import scipy_openblas32

import uform

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGE = os.path.dirname(os.path.abspath(uform.__file__))
LIBRARY = os.path.join(PACKAGE, "libuform.so")
# An in-place build's `uform/` sits in the checkout, beside the C sources.
IN_PLACE = os.path.isdir(os.path.join(os.path.dirname(PACKAGE), "libuform"))
# `python -m uform` in another folder must find the package under test, not the checkout or another install.
PACKAGE_ENV = dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE))


def dynamic(path, tag):
    """The values of one tag of an ELF file's dynamic section, e.g. NEEDED or RUNPATH."""
    section = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [value for line in section.splitlines() if f"({tag})" in line
            for value in re.search(r"\[(.*)\]", line).group(1).split(":")]


def exported(path):
    listing = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in listing.splitlines() if line.strip()]


def flags(*asked):
    return subprocess.run([sys.executable, "-m", "uform", *asked], capture_output=True, text=True, check=True,
                          env=PACKAGE_ENV, cwd="/").stdout.split()


def marked(*patterns):
    """The names the headers matching `patterns` declare with `UFORM_API`."""
    names = set()
    for header in (path for pattern in patterns for path in glob.glob(os.path.join(ROOT, "libuform", pattern))):
        with open(header) as lines:
            text = "".join(line for line in lines if not line.lstrip().startswith("#"))
        names |= set(re.findall(r"UFORM_API[^;]*?\b(uform_\w+)\s*[(;]", text))
    return names


needs_binutils = pytest.mark.skipif(not (shutil.which("nm") and shutil.which("readelf")), reason="no binutils")


@needs_binutils
def test_library_exports_what_its_headers_mark():
    """Every verb of uform.h, the test hooks marked beside it, and nothing else."""
    symbols = set(exported(LIBRARY))
    assert "uform_trainer_step" in marked("include/uform.h") and marked("include/uform.h") <= symbols
    assert symbols <= marked("include/*.h", "src/*.h", "src/media/*.h")
    assert [symbol for symbol in symbols if not symbol.startswith("uform_")] == []


@needs_binutils
def test_extensions_link_the_one_library():
    from uform import _native, _testing

    for module in (_native, _testing):
        assert [symbol for symbol in exported(module.__file__) if symbol.startswith("uform_")] == [], module
        assert "libuform.so" in dynamic(module.__file__, "NEEDED"), module
        assert dynamic(module.__file__, "RUNPATH") == ["$ORIGIN"], module


@needs_binutils
def test_run_paths_hold_no_build_folder():
    """OpenBLAS is found beside the installed package; only an in-place build may also name the
    folder it was built against, which a temporary build environment's would no longer be. No CUDA
    library is needed."""
    paths = dynamic(LIBRARY, "RUNPATH")
    assert paths[:1] == ["$ORIGIN/../scipy_openblas32/lib"] and dynamic(LIBRARY, "RPATH") == []
    openblas = f"lib{scipy_openblas32.get_library()}.so"
    assert [path for path in paths[1:] if not (IN_PLACE and os.path.isfile(os.path.join(path, openblas)))] == []
    assert [name for name in dynamic(LIBRARY, "NEEDED") if re.match(r"lib(cuda|cublas|cudnn|nv)", name)] == []
    plugin = os.path.join(PACKAGE, "libuform_vram.so")
    if os.path.exists(plugin):
        paths = dynamic(plugin, "RUNPATH")
        assert "$ORIGIN/../nvidia/cu13/lib" in paths and "$ORIGIN/../nvidia/cudnn/lib" in paths
        assert [path for path in paths if not path.startswith("$ORIGIN") and not os.path.isdir(path)] == []


def test_header_is_where_the_flags_say():
    include = flags("--include-dir")
    assert include == [os.path.join(ROOT, "libuform", "include") if IN_PLACE else os.path.join(PACKAGE, "include")]
    assert filecmp.cmp(os.path.join(include[0], "uform.h"), os.path.join(ROOT, "libuform", "include", "uform.h"))
    assert flags("--library-dir") == [PACKAGE]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_program_builds_from_the_flags_and_trains(tmp_path):
    """As README's C section says, outside the checkout, and run without LD_LIBRARY_PATH."""
    shutil.copy(os.path.join(HERE, "c", "train.c"), tmp_path)
    subprocess.run(["cc", "-std=c99", "-pedantic-errors", "-Wall", "-Werror", "train.c",
                    *flags("--cflags", "--libs"), "-lm", "-o", "train"], cwd=tmp_path, check=True)
    environment = {name: value for name, value in os.environ.items() if name != "LD_LIBRARY_PATH"}
    result = subprocess.run(["./train", "c.safetensors"], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "trained 6 steps in C" in result.stdout
    assert (tmp_path / "c.safetensors").stat().st_size > 0


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_readmes_c_example_builds_and_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as readme:
        (program,) = re.findall(r"```c\n(.*?)```", readme.read(), re.S)
    (tmp_path / "program.c").write_text(program)
    subprocess.run(["cc", "-std=c99", "-pedantic-errors", "-Wall", "-Werror", "program.c", *flags("--cflags", "--libs"),
                    "-o", "program"], cwd=tmp_path, check=True)
    result = subprocess.run(["./program"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr, result.stderr


def test_uform_config_prints_what_python_m_uform_prints():
    command = shutil.which("uform-config", path=os.path.dirname(sys.executable))
    if IN_PLACE or command is None:
        pytest.skip("uform-config comes with an install")
    printed = subprocess.run([command, "--cflags", "--libs"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert printed.stdout.split() == flags("--cflags", "--libs")


def test_a_source_folder_without_its_extension_says_so(tmp_path):
    # Python run inside a checkout imports its `uform/` folder, which has no extension unless built in
    # place; Python's own words blame a circular import.
    source = tmp_path / "uform"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("*.so", "*.so.*", "__pycache__", "include"))
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}

    def imported(script="import uform"):
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                              env=environment)

    finders = imported("import sys; print(*(getattr(finder, '__module__', '') for finder in sys.meta_path))").stdout
    if "__editable__" in finders:
        pytest.skip("an editable install's finder answers for `uform` before the folder does")
    failed = imported()
    assert failed.returncode != 0
    assert failed.stderr.strip().splitlines()[-1] == (
        f"ImportError: uform: the package imported is the source folder {source}, without its compiled extension "
        "(_native); run from another folder to use the installed package, or build in place with "
        "`python setup.py build_ext --inplace`")
    assert "circular import" not in failed.stderr
    (source / f"_native{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")  # there, but broken
    broken = imported()
    assert broken.returncode != 0 and "the source folder" not in broken.stderr


@needs_binutils
def test_a_package_away_from_site_packages_finds_openblas(tmp_path):
    # An editable install leaves libuform in the checkout, where its run path to the OpenBLAS wheel
    # beside it in site-packages leads nowhere: the package then loads OpenBLAS by the wheel's own path.
    if any(os.path.isabs(path) for path in dynamic(LIBRARY, "RUNPATH")):
        pytest.skip("this build's run path names OpenBLAS's folder itself")
    shutil.copytree(PACKAGE, tmp_path / "uform", ignore=shutil.ignore_patterns("__pycache__"))
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    loaded = subprocess.run([sys.executable, "-c", "import uform; print(uform.__file__)"], capture_output=True,
                            text=True, cwd=tmp_path, env=environment)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == str(tmp_path / "uform" / "__init__.py")
