"""Pickles fuzzed by structure, not bytes: opcode programs that share memoized objects, nest
deeply or use opcodes torch.save never writes, and opcode-level mutations of real torch pickles.
Fed to every reader of pickles (ckpt's tree reader, DCP's metadata unpickler, the DCP item
loader with its torch fallback): only CkptError may escape, quickly, and the tree gate either
refuses a structure or guarantees that walking it costs a bounded multiple of reading it."""

from __future__ import annotations

import io
import pickletools
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tools.security import bounded
from ckpt_tools.security.dcpmeta import load_dcp_metadata
from ckpt_tools.errors import CkptError
from ckpt_tools.security.torchfile import TorchZip, loads

FUZZ = settings(max_examples=150, deadline=3000, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_GLOBALS = [b"ctorch._utils\n_rebuild_tensor_v2\n", b"ccollections\nOrderedDict\n", b"cos\nsystem\n",
            b"cbuiltins\nexec\n", b"cbuiltins\nset\n", b"ctorch\nSize\n", b"cpathlib\nPosixPath\n",
            b"ctorch.distributed.checkpoint.metadata\nMetadata\n"]
_OP = st.one_of(
    st.sampled_from([b"]", b"}", b")", b"(", b"t", b"a", b"e", b"s", b"u", b"2", b"0", b"R", b"b", b"\x81", b"Q",
                     b"N", b"\x88", b"X\x01\x00\x00\x00a", b"\x85", b"\x86", b"\x87", b"l", b"d"]),
    st.integers(0, 7).map(lambda i: b"q" + bytes([i])),  # BINPUT: memoize the top
    st.integers(0, 7).map(lambda i: b"h" + bytes([i])),  # BINGET: a second reference to a memoized object
    st.integers(0, 255).map(lambda i: b"K" + bytes([i])),
    st.sampled_from(_GLOBALS),
)
# a program: a prefix, a block repeated up to thousands of times (depth, sharing), a suffix
_PROGRAM = st.tuples(st.lists(_OP, max_size=12), st.lists(_OP, min_size=1, max_size=6), st.integers(1, 3000),
                     st.lists(_OP, max_size=12))


def _assemble(program) -> bytes:
    prefix, block, times, suffix = program
    return b"\x80\x02" + b"".join(prefix) + b"".join(block) * times + b"".join(suffix) + b"."


def _blob(data_pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def _only_ckpt_errors(fn, *args) -> None:
    try:
        fn(*args)
    except CkptError:
        pass


@FUZZ
@given(program=_PROGRAM)
def test_tree_reader_on_opcode_programs(program) -> None:
    _only_ckpt_errors(loads, _assemble(program))


@FUZZ
@given(program=_PROGRAM)
def test_dcp_metadata_unpickler_on_opcode_programs(tmp_path_factory, program) -> None:
    p = tmp_path_factory.getbasetemp() / "program.metadata"
    p.write_bytes(_assemble(program))
    _only_ckpt_errors(load_dcp_metadata, p)


@settings(FUZZ, max_examples=60)
@given(program=_PROGRAM)
def test_dcp_item_loader_on_opcode_programs(program) -> None:
    """An item goes to ckpt's tree reader, then (unless the structure was refused) to torch's
    weights_only loader: both must stay within CkptError."""
    from ckpt_tools.formats.dcp import load_item

    _only_ckpt_errors(lambda: load_item(_blob(_assemble(program)), where="item"))


# -- opcode-level mutations of a real rank file's pickle -------------------------------------

@pytest.fixture(scope="module")
def real_ops(fixtures_dir: Path) -> list[bytes]:
    """The opcodes (with their arguments, as bytes) of a real FSDP2 rank file's pickle."""
    data = TorchZip(fixtures_dir / "llama_sharded_ws2" / "model_world_size_2_rank_0.pt").pickle
    ops, positions = [], [pos for _, _, pos in pickletools.genops(data)] + [len(data)]
    for a, b in zip(positions, positions[1:]):
        ops.append(data[a:b])
    return ops


_MUTATION = st.lists(st.tuples(st.sampled_from(["dup", "delete", "swap", "get", "nest", "repeat"]),
                               st.integers(0, 10 ** 6), st.integers(0, 10 ** 6), st.integers(1, 64)),
                     min_size=1, max_size=4)


def _mutate(ops: list[bytes], mutations) -> bytes:
    ops = list(ops[1:-1])  # keep PROTO and STOP in place
    for kind, i, j, n in mutations:
        if not ops:
            break
        i, j = i % len(ops), j % len(ops)
        if kind == "dup":
            ops.insert(i, ops[i])
        elif kind == "delete":
            del ops[i]
        elif kind == "swap":
            ops[i], ops[j] = ops[j], ops[i]
        elif kind == "get":  # a second reference to some memoized object
            ops.insert(i, b"h" + bytes([j % 256]))
        elif kind == "nest":  # wrap what follows in lists, n deep, closed further on
            ops[i:i] = [b"]"] * n
            ops.insert(min(len(ops), max(i + n, j)), b"a" * n)
        else:  # share: memoize the top, push it n times as a tuple of itself, repeatedly
            ops.insert(i, (b"q\xf0" + b"(" + b"h\xf0" * n + b"tq\xf0") * 8)
    return b"\x80\x02" + b"".join(ops) + b"."


@FUZZ
@given(mutations=_MUTATION)
def test_tree_reader_on_mutated_rank_file_pickles(real_ops, mutations) -> None:
    _only_ckpt_errors(loads, _mutate(real_ops, mutations))


def test_real_pickle_passes_the_gate(real_ops) -> None:
    tree = loads(b"".join(real_ops))
    bounded.check_tree(tree, where="fixture")


# -- the gate's promise, on arbitrary shapes with sharing -----------------------------------

_DAG = st.lists(st.tuples(st.sampled_from(["list", "tuple", "dict"]), st.integers(0, 10 ** 6), st.integers(0, 10 ** 6)),
                min_size=1, max_size=160)


def _build(ops) -> object:
    nodes: list = [0]
    for kind, i, j in ops:
        a, b = nodes[i % len(nodes)], nodes[j % len(nodes)]
        nodes.append([a, b] if kind == "list" else (a, b) if kind == "tuple" else {"k": a, "v": b})
    return nodes[-1]


def _naive_size(x, cap: int) -> int:
    """Nodes visited by a plain recursive walk (what str() or == would cost), stopping past ``cap``."""
    count = 0

    def walk(y) -> None:
        nonlocal count
        count += 1
        if count > cap:
            raise OverflowError
        for c in (y.values() if isinstance(y, dict) else y if isinstance(y, (list, tuple)) else ()):
            walk(c)

    try:
        walk(x)
    except OverflowError:
        pass
    return count


@settings(FUZZ, max_examples=300)
@given(ops=_DAG)
def test_a_tree_that_passes_walks_in_bounded_time(ops) -> None:
    tree = _build(ops)
    try:
        bounded.check_tree(tree, where="fuzz")
    except bounded.HostileTree:
        return
    cap = max(bounded.MAX_EXPANDED, bounded.RATIO * 4 * (len(ops) + 1))
    assert _naive_size(tree, cap) <= cap
