"""Helper processes die with the process that started them.

``--workers`` processes and the processes of a ``torchrun`` launch wait on their parent (a
queue, a collective). If the parent is killed outright (SIGKILL, the OOM killer) nothing tells
them, and they wait forever, re-parented to init, holding the multiprocessing resource
tracker alive with them. :func:`tie_to_parent` makes a process follow its parent within a
fraction of a second: the kernel's parent-death signal where Linux offers it, and a watchdog
thread that polls the parent's pid everywhere (and covers the gap before the signal is set).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from ..errors import UsageError
from . import env

_PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.2
_tied: set[int] = set()


def tie_to_parent(parent: int | None = None, *, kernel_signal: bool = True) -> None:
    """End this process (SIGKILL, no cleanup: its parent owned the work) as soon as ``parent``
    (default: the current parent) is gone. Safe to call more than once.

    ``kernel_signal``: also arm Linux's parent-death signal, which fires when the parent
    *thread* that started this process ends; pass False when that thread may end before the
    parent does (a launcher not ours, such as torchrun's agent): the watchdog alone then acts."""
    parent = os.getppid() if parent is None else parent
    if parent in _tied:
        return
    _tied.add(parent)
    if kernel_signal and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the watchdog alone does it
            pass
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent,), name="ckpt-lifeline", daemon=True).start()


def tie_to_launcher() -> None:
    """In a process of a ``torchrun`` launch, :func:`tie_to_parent` on the launcher's agent, as
    early as possible. One already re-parented to init (``getppid() == 1``: the agent died
    before this process got here) ends at once."""

    try:
        launched = env.world() > 1
    except UsageError:  # a malformed launch: the command reports it, where its errors are said
        return
    if launched:
        if os.getppid() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        tie_to_parent(kernel_signal=False)


def end_if_orphaned() -> None:
    """End this process now (SIGKILL, as the watchdog would within ``POLL_SECONDS``) if a parent
    it is tied to is gone: called just before an irreversible step (a commit), so work whose
    owner was killed is never published."""
    if _tied and os.getppid() not in _tied:
        os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
