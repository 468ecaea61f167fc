"""``python -m ckpt_tools.runtime.child SPEC``: one helper process of :mod:`.procs`.

Reads SPEC, only from a private directory of this user's (:mod:`.private`): the caller's
``sys.path`` and the functions it passes (a JSON line, never unpickled), then the work (a
function by reference and its arguments, pickled by the parent as multiprocessing would send
them down a pipe, read by :func:`.private.load`, which looks up nothing else); runs it,
and writes ``("ok", value)`` or ``("error", exception, traceback)`` beside SPEC (``NAME.out``).
The caller's ``__main__`` is never imported. Input checkpoints never come through here.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from pathlib import Path

from . import private


def main(spec: str) -> int:
    spec_path = Path(spec)
    with private.open_read(spec_path) as f:  # written by our parent into its private directory
        head = json.loads(f.readline())  # plain data: never unpickled
        sys.path[:] = head["sys_path"] + [p for p in sys.path if p not in head["sys_path"]]
        from .lifeline import tie_to_parent

        tie_to_parent(head["parent"])
        try:
            fn, args = private.load(f, head.get("admit", ()))  # only the globals the parent named
            outcome: tuple = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - everything goes back to the parent
            outcome = ("error", e, traceback.format_exc())
    return report(spec_path.with_suffix(".out"), outcome)


def report(out: Path, outcome: tuple) -> int:
    """Write ``outcome`` to ``out`` (private, whole or not at all) for the parent; the exit code."""
    tmp = out.with_suffix(".out-tmp")
    try:
        data = pickle.dumps(outcome)
        if not private.admitted(data):  # names a class the parent's reader does not look up
            raise pickle.PicklingError(type(outcome[1]).__name__)
    except Exception:  # an exception or result that does not pickle (or would be refused): its text does
        data = pickle.dumps(("error", RuntimeError(f"{outcome[1]!r}"), traceback.format_exc()))
    with private.open_write(tmp) as f:
        f.write(data)
    os.replace(tmp, out)
    return 0 if outcome[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
