"""The package version, in a module that imports nothing: modules that record it (the manifest,
the architecture check's memory) take it from here, not from the package that imports every
command."""

__version__ = "0.1.0"
