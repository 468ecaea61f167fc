"""The ``ckpt`` command line: thin click commands over ``ckpt_tools`` (installed as ``ckpt_tools.cli``)."""
