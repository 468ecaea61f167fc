"""Seeded byte mutations of a pickle, for the tests that hold a fast reader to the careful one."""

from __future__ import annotations

import random
from collections.abc import Iterator


def mutations(data: bytes, seed: int, n: int) -> Iterator[bytes]:
    """``n`` copies of ``data``, each with one to three bytes flipped, inserted or deleted, or
    cut short."""
    rng = random.Random(seed)
    for _ in range(n):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(buf))
            kind = rng.randrange(4)
            if kind == 0:
                buf[i] ^= rng.randint(1, 255)
            elif kind == 1:
                buf[i:i] = bytes([rng.randrange(256)])
            elif kind == 2:
                del buf[i]
            else:
                del buf[i:]
            if not buf:
                break
        yield bytes(buf)
