"""Trees unpickled from untrusted files, measured before anything walks them.

A pickle's memo lets one object be referenced any number of times: 60 levels of "a list
holding the previous level twice" is about 1 KB on disk and 2**60 nodes to anything that walks
it as a tree (``str()``, ``==``, a recursive visitor). A pickle also nests 200,000 levels deep
without its (iterative) unpickler noticing, and every recursive walker then raises
RecursionError. :func:`check_tree` is the one gate every loader passes its result through:

- it visits each distinct container once (recursing no deeper than :data:`MAX_DEPTH`, far
  inside Python's limit), so its own cost is linear in what the file holds;
- it refuses (:class:`HostileTree`, a BadInput) a tree deeper than :data:`MAX_DEPTH`, a
  container that contains itself, or a tree whose size walked as a tree (shared nodes counted
  each time they are reached) is more than :data:`RATIO` times the work of walking it once, so
  any later walk costs at most a constant factor more than reading the file did.

Real checkpoints are far inside these bounds (depth under 30; sharing limited to a device mesh
per DTensor, a ratio under 3).

Hashing is the other walk: an unpickler inserting a dict key hashes it at once, recursively and
in C (a shared tuple key hangs, one nested 200,000 deep segfaults). :func:`guard_dispatch` gives a
pure-Python unpickler key checks (:func:`check_key`) that run before any hash does.
"""

from __future__ import annotations

import contextlib
import gc
from sys import getrefcount
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import BadInput, brief

MAX_DEPTH = 100
RATIO = 16
MAX_EXPANDED = 1_000_000  # below this, sharing costs nothing worth refusing for

# node types of other modules whose children are not those of a container (torchfile's
# Reduce/NewObj, dcpmeta's records): type -> children
_NODES: dict[type, Callable[[Any], Iterable[Any]]] = {}
# type -> why a node of it contains itself, for the refusal (default: a corrupt or hostile file)
_CYCLES: dict[type, Callable[[Any], str]] = {}


class HostileTree(BadInput):
    """A pickled tree too deep, cyclic, or sharing nodes enough to blow up any walk of it; or
    keyed by values whose hash would (Python does not cache a tuple's hash, and computes it
    recursively in C: a shared or deeply nested tuple key hangs or crashes the process)."""


def register(cls: type, children: Callable[[Any], Iterable[Any]], cycle: Callable[[Any], str] | None = None) -> None:
    """Teach the walker the children of ``cls`` (and its subclasses, looked up by exact type
    first), and ``cycle``, what its refusal says of such a node that contains itself."""
    _NODES[cls] = children
    _OPAQUE.clear()
    _OPAQUE.update(_INERT)
    if cycle is not None:
        _CYCLES[cls] = cycle


def _cycle(x: Any) -> str:
    fn = next((f for cls, f in _CYCLES.items() if isinstance(x, cls)), None)
    if fn is not None:
        return fn(x)
    return f"the pickle holds a {type(x).__name__} that contains itself; a checkpoint never does (corrupt or hostile file)"


_LEAVES = frozenset({str, int, float, bool, bytes, type(None)})


def children(x: Any) -> Iterable[Any] | None:
    """The children of a container or registered node; None for a leaf."""
    t = type(x)
    if t in _LEAVES or t in _OPAQUE:
        return None
    if t is tuple or t is list:
        return x
    fn = _NODES.get(t)
    if fn is not None:
        return fn(x)
    if isinstance(x, dict):
        extra = getattr(x, "__dict__", None)  # an OrderedDict state dict's ``_metadata``
        items = [v for kv in x.items() for v in kv]
        return [*items, extra] if extra else items
    if isinstance(x, (list, tuple, set, frozenset)):
        return x
    for cls, fn in list(_NODES.items()):
        if isinstance(x, cls):
            _NODES[t] = fn  # a subclass: found directly next time
            return fn(x)
    _OPAQUE.add(t)  # no container, no node: every object of this type is a leaf
    return None


# types found to have no children (a torch pickle's Global nodes, one-character strings, dtypes):
# known by their type at once; emptied when a node type is registered
_OPAQUE: set[type] = set()
# types declared leaves (:func:`inert`): in _OPAQUE always
_INERT: set[type] = set()


def inert(cls: type) -> None:
    """Declare ``cls`` a leaf: its objects are built only by ckpt's own readers, of names,
    ints and flat tuples of ints (:mod:`.dcprows`), so nothing in one needs walking."""
    _INERT.add(cls)
    _OPAQUE.add(cls)


_FLAT = 8  # a tuple of leaves at most this long is walked where it stands (check_tree)
_FLAT_NODE = 16  # and a node of at most this many leaves and such tuples


def check_tree(tree: Any, *, where: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`HostileTree` naming ``where`` if ``tree`` is too deep, cyclic, or blows up
    when walked as a tree; else return, having touched each distinct container once."""
    kids = children(tree)
    if kids is None:
        return
    sizes: dict[int, int] = {}  # id -> size walked as a tree, for finished containers held twice or more
    active: set[int] = set()
    deep: set[type] = set()  # types of nodes found holding more than leaves and short tuples
    work = 0

    # recursion, bounded by max_depth (far below Python's limit): the fastest walk in Python
    def size(node: Any, kids: Iterable[Any], depth: int) -> int:
        nonlocal work
        nid = id(node)
        active.add(nid)
        total = 1
        # the references a child held once has as it is looked at (:func:`_held_once`)
        once = _held_once(node, kids)
        for child in kids:
            work += 1
            if type(child) in _LEAVES or type(child) in _OPAQUE:
                total += 1
                continue
            if type(child) is tuple and len(child) <= _FLAT and depth < max_depth:
                # a short tuple of leaves (a shape, an offset: a third of a DCP .metadata's
                # nodes) counted where it stands, without a call: each time it is met, it costs
                # what it counts (at most _FLAT + 1), so no amount of sharing makes it a bomb
                for leaf in child:
                    if type(leaf) not in _LEAVES:
                        break
                else:
                    work += len(child)
                    total += len(child) + 1
                    continue
            cid = id(child)
            known = sizes.get(cid)
            if known is not None:
                total += known
                continue
            grand = children(child)
            if grand is None:
                total += 1
                continue
            if type(child) not in deep and depth + 2 <= max_depth and len(grand) <= _FLAT_NODE:
                # a node of leaves and short tuples of leaves (a DCP record) counted where it
                # stands, like a short tuple: it holds nothing that could hold it, and each
                # time it is met it costs what it counts. A type found holding more once is
                # not looked at this way again (most of a torch pickle's nodes)
                flat = 1
                for g in grand:
                    if type(g) in _LEAVES or type(g) in _OPAQUE:
                        flat += 1
                    elif type(g) is tuple and len(g) <= _FLAT:
                        for leaf in g:
                            if type(leaf) not in _LEAVES:
                                break
                        else:
                            flat += len(g) + 1
                            continue
                        break
                    else:
                        break
                else:
                    work += flat
                    total += flat
                    continue
                deep.add(type(child))
            if cid in active:
                raise HostileTree(f"{where}: {_cycle(child)}")
            if depth >= max_depth:
                raise HostileTree(f"{where}: the pickle nests deeper than {max_depth} levels; a checkpoint "
                                   "never does (corrupt or hostile file)")
            shared = getrefcount(child) > once + (grand is child)
            got = size(child, grand, depth + 1)
            if shared:
                sizes[cid] = got
            total += got
        active.discard(nid)
        return total

    try:
        total = size(tree, kids, 1)
    finally:
        # ``size`` holds itself (it recurses through its closure): a cycle that would keep its
        # table of every container (~50 MB at 25k tensors) until the collector runs, which a
        # description's paused collector does not
        size = None  # noqa: F841
        sizes.clear()
    if total > max(MAX_EXPANDED, RATIO * (work + 1)):
        raise HostileTree(f"{where}: the pickle reuses shared objects to stand for {_magnitude(total)} nodes "
                           f"from {work + 1} ({'a billion laughs' if total > 1 << 40 else 'far more than a checkpoint'}); "
                           "refusing it (corrupt or hostile file)")


def _held_once(node: Any, kids: Iterable[Any]) -> int:
    """The references :func:`check_tree`'s walk sees to a child of ``node`` (met in ``kids``, its
    children) that only one holder has: the holder's, the walk's name for it, getrefcount's
    argument, and one more where ``kids`` is a tuple or list made for the walk (a node's
    ``(func, args, state)``, a dict's items), which holds it too. A child held once is met once,
    so only the others' sizes are noted: most of a torch pickle's ~20 containers per tensor are
    held once (at 25k tensors, noting every one cost ~40 MB). ``getrefcount`` of such a made
    ``kids`` is 4 (the walk's two names for it, this call's and the argument); a node's own
    tuple or list has a holder more. Any miscount errs towards noting a child: one held twice
    never has fewer references than this."""
    made = kids is not node and type(kids) in (tuple, list) and getrefcount(kids) <= 4
    return 3 + made


def distinct_nodes(tree: Any) -> Iterator[Any]:
    """Every node of ``tree`` once (containers by identity), iteratively; for a walker that only
    asks "is there a node of this kind" of a tree :func:`check_tree` has passed."""
    seen: set[int] = set()
    todo = [tree]
    while todo:
        x = todo.pop()
        yield x
        kids = children(x)
        if kids is not None and id(x) not in seen:
            seen.add(id(x))
            todo.extend(kids)


def _magnitude(n: int) -> str:
    return f"about 2^{n.bit_length() - 1}" if n > 1 << 40 else f"{n:,}"


_PROMOTE = False


def promote_after_pauses() -> None:
    """For a command that builds little after its description (inspect): what a
    ``gc_paused(promote=True)`` built goes to the collector's oldest generation as the pause
    ends (``gc.freeze`` then ``gc.unfreeze``). Otherwise the first pass after the pause walks
    every object built in it (a 256-rank description: 0.2-0.5 s), and the next passes again.
    Still collected by a full pass; not done for commands that go on to plan and copy, whose
    peak memory it raised (their cyclic garbage waits for the rarer full passes)."""
    global _PROMOTE
    _PROMOTE = True


@contextlib.contextmanager
def gc_paused(*, promote: bool = False) -> Iterator[None]:
    """No cyclic garbage collection while a file's many small objects are built: each pass of
    the collector walks the whole growing heap, which makes building N objects cost N^2
    (10^5 DCP items: 3.4 s instead of 1.1 s). Pickles and descriptions hold no cycles to free.
    ``promote``: a description, which lives to the command's end: see :func:`promote_after_pauses`."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _FROZEN_DEPTH:  # within gc_frozen: what the pause built lives to its end too
            gc.freeze()
        if was:
            if _PROMOTE and promote and not _FROZEN_DEPTH:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """What is alive as it starts (a description and its plan: many small objects that live to
    the end) set aside from the cyclic collector (``gc.freeze``) while work that builds and
    drops small objects runs: the collector's passes then walk only what that work builds. A
    256 -> 192 reshard's full passes walked 1.5 million live objects: 15% of its time. Within
    it, a nested block and the end of each :func:`gc_paused` set aside what is alive then too
    (a command's description and plan as each is built: the first passes after a pause walked
    everything built in it, 2.2 s of a 25k-tensor reshard). After the outermost, all are back
    in the oldest generation (``gc.unfreeze``), collectable as before. Left as it is where the
    process froze objects of its own (a fork server's)."""
    global _FROZEN_DEPTH
    if not _FROZEN_DEPTH and gc.get_freeze_count():
        yield
        return
    _FROZEN_DEPTH += 1
    gc.freeze()  # (adds to what an outer block set aside)
    try:
        yield
    finally:
        _FROZEN_DEPTH -= 1
        if not _FROZEN_DEPTH:
            gc.unfreeze()


_FROZEN_DEPTH = 0  # gc_frozen blocks entered and not left


MAX_KEY_ITEMS = 1024


def check_key(key: Any) -> None:
    """Refuse (HostileTree) a dict key or set member from a pickle whose hash is not cheap: only
    names, numbers, flat tuples of them, and types that declare a safe hash of their own
    (``_safe_hash = True``) are admitted. Called before the unpickler inserts it."""
    t = type(key)
    if t in _LEAVES or isinstance(key, (str, int, float, bytes)) and t.__hash__ in _PLAIN_HASHES:
        return
    if t is tuple and len(key) <= MAX_KEY_ITEMS and all(type(k) in _LEAVES or isinstance(k, str) for k in key):
        return
    if getattr(t, "_safe_hash", False):
        return
    raise HostileTree(f"the pickle keys a dict by a {t.__name__} ({brief(key)}); checkpoints key by names and numbers")


_PLAIN_HASHES = frozenset({str.__hash__, int.__hash__, float.__hash__, bytes.__hash__})


def guard_dispatch(dispatch: dict) -> dict:
    """A pure-Python unpickler's dispatch table with every opcode that hashes a value it built
    (SETITEM, SETITEMS, DICT) checking the key with :func:`check_key` first, and the set
    opcodes (protocol 4: EMPTY_SET, ADDITEMS, FROZENSET; neither torch.save nor dcp.save writes
    them) refused."""
    import pickle

    def load_setitem(self: Any) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        check_key(key)
        self.stack[-1][key] = value

    def load_setitems(self: Any) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        for i in range(0, len(items) - 1, 2):
            check_key(items[i])
            target[items[i]] = items[i + 1]

    def load_dict(self: Any) -> None:
        items = self.pop_mark()
        for k in items[::2]:
            check_key(k)
        self.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})

    def refuse_set(self: Any) -> None:
        raise HostileTree("the pickle builds a set with opcodes checkpoints never use")

    out = dict(dispatch)
    out.update({pickle.SETITEM[0]: load_setitem, pickle.SETITEMS[0]: load_setitems, pickle.DICT[0]: load_dict,
                pickle.EMPTY_SET[0]: refuse_set, pickle.ADDITEMS[0]: refuse_set, pickle.FROZENSET[0]: refuse_set})
    return out


def safe_set(items: Any = ()) -> set:
    """``set(items)`` for an unpickler's REDUCE, each member checked with :func:`check_key`."""
    items = list(items)
    for k in items:
        check_key(k)
    return set(items)


def safe_frozenset(items: Any = ()) -> frozenset:
    return frozenset(safe_set(items))
