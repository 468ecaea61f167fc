"""``python -m ckpt_tools.runtime.child SPEC``: one helper process of :mod:`.procs`.

Reads the caller's ``sys.path`` and then the work (a function and its arguments) from SPEC,
runs it, and writes ``("ok", value)`` or ``("error", exception, traceback)`` beside SPEC
(``NAME.out``). The caller's ``__main__`` is never imported.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path


def main(spec: str) -> int:
    spec_path = Path(spec)
    with open(spec_path, "rb") as f:  # written by our parent into its private directory
        head = pickle.load(f)
        sys.path[:] = head["sys_path"] + [p for p in sys.path if p not in head["sys_path"]]
        from .lifeline import tie_to_parent

        tie_to_parent(head["parent"])
        fn, args = pickle.load(f)
    try:
        outcome: tuple = ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - everything goes back to the parent
        outcome = ("error", e, traceback.format_exc())
    out = spec_path.with_suffix(".out")
    tmp = spec_path.with_suffix(".out-tmp")
    try:
        data = pickle.dumps(outcome)
    except Exception:  # an exception or result that does not pickle: its text does
        data = pickle.dumps(("error", RuntimeError(f"{outcome[1]!r}"), traceback.format_exc()))
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return 0 if outcome[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
