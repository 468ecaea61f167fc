"""The prefixes that training wrappers add to parameter names (``torch.compile``'s ``_orig_mod.``,
DDP's ``module.``, FSDP1's ``_fsdp_wrapped_module.``, activation checkpointing's
``_checkpoint_wrapped_module.``), which no model class loads: removed wherever names are matched."""

from __future__ import annotations

import re

_WRAPPER_PREFIXES = re.compile(r"(^|\.)(_orig_mod|module|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")


def normalize_name(name: str) -> str:
    """A weight name as ``from_pretrained`` expects it: wrapper prefixes removed."""
    while True:
        new = _WRAPPER_PREFIXES.sub(r"\1", name)
        if new == name:
            return name
        name = new
