"""A training script's arguments pickled beside its checkpoint, read as inert data.

Megatron-LM saves its ``argparse.Namespace`` (``args``) in the checkpoint's common state, which
Megatron-Core's ``torch_dist`` strategy writes to ``common.pt``: the one record of what the
weights mean beyond their shapes (the activation, the normalization, the rotary convention).
``torch.load(weights_only=True)`` refuses the Namespace; here it is read by
:class:`~.torchfile.TorchZip`'s tree reader with the Namespace and Megatron-Core's enums
admitted as inert names (never imported, never constructed), exactly as :mod:`.dcpmeta` reads
DCP's dataclasses. Any other class is refused (``UnsafeInput``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .torchfile import Global, NewObj, Reduce, TorchZip

_ENUMS = {"megatron.core.transformer.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend",
                                              "CudaGraphScope"),
          "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe")}
CLASSES: frozenset[tuple[str, str]] = frozenset(
    [("argparse", "Namespace"), *((module, name) for module, names in _ENUMS.items() for name in names)])


def read(path: Path | str, key: str = "args") -> dict[str, Any] | None:
    """The fields of the Namespace saved under ``key`` in the ``torch.save`` file ``path`` (plain
    values; a dtype as ``"torch.bfloat16"``, an enum as its value), or None when there is none."""
    tree = TorchZip(path, admit=CLASSES).tree
    node = tree.get(key) if isinstance(tree, dict) else None
    if not (type(node) is NewObj and type(node.cls) is Global and (node.cls.module, node.cls.name) ==
            ("argparse", "Namespace") and isinstance(node.state, dict)):
        return None
    return {k: _plain(v) for k, v in node.state.items() if isinstance(k, str)}


def _plain(value: Any) -> Any:
    if type(value) is Global:
        return f"{value.module}.{value.name}"
    if type(value) is Reduce and type(value.func) is Global and len(value.args) == 1:
        return _plain(value.args[0])  # an enum: its value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
