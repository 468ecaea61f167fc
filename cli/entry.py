"""The ``ckpt`` program's first moment: imported first by the console script (``cli/main.py``) and
``python -m ckpt_tools``.

Importing this module makes a Ctrl-C from now on end the program with one ``error:`` line and
exit code 130, before click, torch or any command module is imported: an interrupt while the
program is still loading is not a traceback. Once a command is under way, :func:`ready` hands
SIGINT back to Python's ``KeyboardInterrupt``, which the command turns into its own message,
after it has removed its staging (``cli/main.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_MESSAGE = b"error: interrupted while starting; nothing was written, the destination was left as it was\n"


def _interrupted(signum, frame) -> None:
    # nothing to clean up yet: no command has started writing
    os.write(2, _MESSAGE)
    os._exit(130)


def _is_the_program() -> bool:
    """The ``ckpt`` console script or ``python -m ckpt_tools``, not a library user (a test
    importing ``cli.main`` keeps its own Ctrl-C)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == "ckpt_tools.__main__" or os.path.basename(sys.argv[0] or "") == "ckpt"


# The program does no linear algebra: numpy's OpenBLAS would start a thread per core that spins
# after numpy is imported, on the cores a cast's converter and writer need (a 1.2 GiB fp16 cast
# ~4% faster without). Only the program's own process and those it starts: a script's numpy
# is left as it is.
if _is_the_program():
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A SIGINT the parent chose to ignore (a background job of a script) stays ignored.
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)


def ready() -> None:
    """A command starts: Ctrl-C raises KeyboardInterrupt again, for the command to report."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_now(code: int) -> None:
    """End the program with ``code`` at once (after flushing what it printed)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
