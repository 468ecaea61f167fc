"""Megatron-Core GPT names, recognised so that an export refuses them rather than writing them.

Megatron-Core's ``sharded_state_dict`` names a GPT's weights its own way
(``embedding.word_embeddings.weight``, ``decoder.layers.self_attention.linear_qkv.weight`` with
the layers stacked on a leading axis and Q, K, V fused and interleaved per query group,
``output_layer.weight``). No map from them to a Hugging Face architecture's names is written
yet (it would be one table like :mod:`.torchtitan`'s, plus the QKV split and the layer axis
unstacked); until then ``export`` (and ``convert --to hf``) is exit 3 naming what is missing,
and ``convert --to dcp`` keeps the save as the DCP it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import BadInput

_MARKS = ("decoder.layers.", "embedding.word_embeddings.weight", "output_layer.weight")


def detect(names: Iterable[str]) -> bool:
    """Whether the model's names are Megatron-Core's (a GPT's decoder layers or embedding)."""
    return any(n.startswith(_MARKS) for n in names)


def refuse(names: Iterable[str], src: Path) -> BadInput:
    """The error for an export of Megatron-Core names: which names, and what is missing."""
    names = sorted(n for n in names if n.startswith(_MARKS))
    return BadInput(f"{src}: holds Megatron-Core names ({names[0]}, ... {len(names)} in all; layers stacked, QKV "
                    "fused), for which ckpt has no map to Hugging Face names yet: export needs a name map for this "
                    "model family (naming/); convert --to dcp keeps it as the DCP it is")
