"""The few classes a DeepSpeed ZeRO save pickles, admitted as inert names.

A ZeRO optimizer file (``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``) pickles the loss
scaler (``LossScaler`` or ``DynamicLossScaler``), the stage (``ZeroStageEnum``) and, per
parameter, where its fragment lies (``tensor_fragment.fragment_address``). ``torch.load(
weights_only=True)`` refuses them, and DeepSpeed's own ``zero_to_fp32`` unpickles them with
code execution. Here they are read as DCP's dataclasses are in :mod:`.dcpmeta`: the names are
admitted into :class:`~.torchfile.TorchZip`'s tree reader, which keeps each as an inert
:class:`~.torchfile.Global` node (its arguments and state plain data); nothing is imported or
constructed, and any other class is refused (``UnsafeInput``, exit 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .torchfile import Global, NewObj, Reduce, TorchZip

_RT = "deepspeed.runtime"
CLASSES: frozenset[tuple[str, str]] = frozenset([
    (f"{_RT}.fp16.loss_scaler", "LossScaler"),
    (f"{_RT}.fp16.loss_scaler", "DynamicLossScaler"),
    (f"{_RT}.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    # stage 3's fp32_flat_groups are plain tensors pickled with their attributes:
    # _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, args, state), as torch pickles a
    # tensor whose __dict__ is not empty (weights_only admits it too)
    ("torch", "Tensor"),
])


def read(path: Path | str) -> TorchZip:
    """A ZeRO model- or optimizer-states file as an inert tree (see the module doc)."""
    return TorchZip(path, admit=CLASSES)


def plain_tensor(node: Any) -> Any:
    """A tensor node pickled through ``_rebuild_from_type_v2(..., torch.Tensor, args, state)``
    as the plain ``_rebuild_tensor_v2(*args)`` node it wraps (its attributes dropped); any
    other node as is."""
    if (type(node) is Reduce and node.func.name == "_rebuild_from_type_v2" and len(node.args) == 4
            and type(node.args[1]) is Global and (node.args[1].module, node.args[1].name) == ("torch", "Tensor")
            and type(node.args[0]) is Global and type(node.args[2]) is tuple):
        return Reduce(node.args[0], node.args[2])
    return node


def enum_value(node: Any) -> Any:
    """The value an inert ``ZeroStageEnum(2)`` node was pickled with (else the node as is)."""
    if type(node) is Reduce and node.func.name == "ZeroStageEnum" and len(node.args) == 1:
        return node.args[0]
    return node


def fields(node: Any) -> dict:
    """The pickled fields of an inert object node (a loss scaler, a ``fragment_address``)."""
    if isinstance(node, (Reduce, NewObj)) and isinstance(node.state, dict):
        return dict(node.state)
    return {}
