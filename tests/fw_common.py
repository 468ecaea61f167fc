"""What every framework job in the tests shares: the tiny model and the fixed global batches.

Every job trains on the same global batch per step (12 sequences, divisible by 1, 2, 3, 4 and
6 ranks), split evenly over its ranks, so a run resumed at another world size sees exactly the
data of the uninterrupted one and its losses agree up to float summation order.
"""

from __future__ import annotations

GLOBAL_BATCH = 12
SEQ = 8
VOCAB = 101


def tiny_model(seed: int = 0, *, tied: bool = False, odd: bool = False):
    """The tiny Llama; ``odd``: widths whose FSDP1 units (6510 elements per decoder layer,
    6090 or 3060 at the root) do not divide 4 or 3 ranks, so flat parameters are padded."""
    import torch
    from make_fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(tied=tied)
    if odd:
        config.hidden_size, config.intermediate_size = 30, 45
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 3, 1, 10
    return LlamaForCausalLM(config)


def global_batch(step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def batch_for(step: int, rank: int, world_size: int):
    per = GLOBAL_BATCH // world_size
    return global_batch(step)[rank * per:(rank + 1) * per]


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b))
