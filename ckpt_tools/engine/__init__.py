"""The one engine that moves bytes: reads what a plan names, streams it to a format's writer,
stages and commits, in one process, a pool of workers or a ``torchrun`` launch. Knows no format
by name: writers are passed in."""
