"""Prints what a C program needs to build against this package's `libuform.so`:

    cc -std=c99 program.c $(python -m uform --cflags --libs) -o program

`--libs` links with a run path to the package's folder, so the program finds the library without
LD_LIBRARY_PATH. The same works through the `uform-config` command, which also runs from the
checkout's root, where `python -m uform` would find the uncompiled `uform/` first.
"""
import argparse
import os

PACKAGE = os.path.dirname(os.path.abspath(__file__))


def include_dir():
    """`uform/include/` in an installed package; the checkout's `libuform/include/` beside an in-place build."""
    installed = os.path.join(PACKAGE, "include")
    if os.path.isfile(os.path.join(installed, "uform.h")):
        return installed
    return os.path.join(os.path.dirname(PACKAGE), "libuform", "include")


def openblas_flags():
    """Nothing where libuform's run path finds OpenBLAS beside the package in site-packages. An editable
    install's libuform lies in the checkout, where that path leads nowhere, so the program then needs
    OpenBLAS itself, by the wheel's own folder: a program's run path serves its own needs alone."""
    if os.path.isdir(os.path.join(os.path.dirname(PACKAGE), "scipy_openblas32", "lib")):
        return []
    import scipy_openblas32

    folder = scipy_openblas32.get_lib_dir()
    return [f"-L{folder}", "-Wl,--push-state,--no-as-needed", f"-l{scipy_openblas32.get_library()}",
            "-Wl,--pop-state", f"-Wl,-rpath,{folder}"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m uform", description="Flags for C programs that use libuform.")
    parser.add_argument("--cflags", action="store_true", help="the compiler's flags: where uform.h is")
    parser.add_argument("--libs", action="store_true", help="the linker's flags, with a run path to libuform.so")
    parser.add_argument("--include-dir", action="store_true", help="the folder that holds uform.h")
    parser.add_argument("--library-dir", action="store_true", help="the folder that holds libuform.so")
    args = parser.parse_args(argv)
    words = ([include_dir()] if args.include_dir else []) + ([PACKAGE] if args.library_dir else [])
    words += [f"-I{include_dir()}"] if args.cflags else []
    words += [f"-L{PACKAGE}", "-luform", f"-Wl,-rpath,{PACKAGE}"] + openblas_flags() if args.libs else []
    if not words:
        parser.error("ask for at least one of --cflags, --libs, --include-dir, --library-dir")
    print(" ".join(words))


if __name__ == "__main__":
    main()
