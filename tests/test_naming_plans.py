"""The pure parts of the naming schemes, with small numbers: the rotary row maps against the
tensor formula torchtitan and Hugging Face use, and row-permuted pieces across shard layouts."""

from __future__ import annotations

import pytest
import torch

from ckpt_tools.core.describe import Chunk, Location, TensorInfo
from ckpt_tools.core.dtypes import DType
from ckpt_tools.naming import torchtitan
from ckpt_tools.core.plan import Target, permuted_rows


@pytest.mark.parametrize("n_heads,head_dim", [(1, 2), (4, 8), (2, 16), (8, 4)])
def test_row_maps_are_the_view_transpose_formula(n_heads, head_dim):
    rows = n_heads * head_dim
    w = torch.arange(rows * 3).reshape(rows, 3)
    hf = w.view(n_heads, head_dim // 2, 2, 3).transpose(1, 2).reshape(rows, 3)  # torchtitan's _permute
    assert torch.equal(w[torchtitan.to_hf_rows(n_heads, rows)], hf)
    assert torch.equal(hf[torchtitan.from_hf_rows(n_heads, rows)], w)


def _tensor(rows: int, splits: list[int]) -> TensorInfo:
    chunks, at = [], 0
    for r, n in enumerate(splits):
        chunks.append(Chunk((at, 0), (n, 3), Location(f"f{r}", "raw"), r))
        at += n
    assert at == rows
    return TensorInfo("model", "w", (rows, 3), DType("float32"), tuple(chunks))


@pytest.mark.parametrize("splits", [[8], [3, 3, 2], [4, 4], [5, 3, 0]])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_permuted_pieces_take_each_row_from_the_chunk_that_holds_it(splits, world_size):
    t = _tensor(8, splits)
    rows = torchtitan.to_hf_rows(2, 8)
    target = Target(t, "model", "w", t.dtype)
    got = []
    for r in range(world_size):
        p = permuted_rows(target, rows, rank=r, world_size=world_size)
        for c in p.copies:
            assert c.sizes == (1, 3) and 0 <= c.src_start[0] < c.chunk.sizes[0]
            got.append((p.offsets[0] + c.dst_start[0], c.chunk.offsets[0] + c.src_start[0]))
    assert sorted(got) == list(enumerate(rows))


def test_a_row_map_that_is_not_a_permutation_is_a_bug():
    t = _tensor(4, [4])
    with pytest.raises(ValueError):
        permuted_rows(Target(t, "model", "w", t.dtype), [0, 0, 1, 2])


@pytest.mark.parametrize("names,expected", [
    (["tok_embeddings.weight", "norm.weight"], True),
    (["layers.0.attention.wq.weight"], True),
    (["layers.3.feed_forward.w1.weight"], True),
    (["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"], False),
    (["layers.0.weight"], False),
])
def test_torchtitan_names_are_recognised_from_the_names(names, expected):
    assert torchtitan.detect(names) is expected
