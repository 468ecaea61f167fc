"""``python -m ckpt_tools``: the ``ckpt`` program. The entry module comes first: from here on, a
Ctrl-C while the program loads is one ``error:`` line, not a traceback."""

from ckpt_tools.cli import entry  # noqa: F401

from ckpt_tools.cli.main import run  # noqa: E402

run()
