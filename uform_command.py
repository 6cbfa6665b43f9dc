"""The `uform` command's entry point, outside the `uform` package: importing any module of the package runs
its `__init__` first, which loads numpy and the native library, a second or more. A Ctrl-C meanwhile ends
the command quietly with 130, 128 + SIGINT's number, as the shell expects of a program it interrupted; once
`uform.cli` is loaded, its `main` answers SIGINT itself."""

import signal


def main() -> int:
    try:
        from uform.cli import main as command
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return command()
