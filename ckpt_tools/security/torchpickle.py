"""A faster careful reader of ``torch.save``'s protocol-2 pickles, for the tree reader of
:mod:`~ckpt_tools.security.torchfile`.

The careful reader (``pickle._Unpickler`` with torchfile's dispatch) costs ~0.4 µs an opcode: a
method call, a ``read`` and a dispatch per opcode. A rank file of 25k DTensors holds 3.3 million
opcodes (1.3 s). :func:`load` runs the same steps over the pickle's bytes in one loop with the
stack in local variables, and takes each memo put that follows an opcode with it.

Like :mod:`~ckpt_tools.security.fastpickle` (the same for DCP's ``.metadata``), it is an
accelerator, never a second judge. It does what the careful reader does through the same
calls: globals through its ``find_class``, persistent ids through its ``persistent_load``,
REDUCE, NEWOBJ and BUILD through torchfile's node builders (``nodes``), strings of one
character or none through its string type, every dict key through
:func:`~ckpt_tools.security.bounded.check_key` before it is hashed. It knows only the opcodes
torch's pickler writes at protocol 2; on anything else (another opcode or protocol, a memo get
of an index never put, a put past the memo's end, a truncated argument, any exception raised by
what it calls) it raises :class:`Decline`, and the caller reads the pickle the careful way from
the start, so a refusal and its message are always the careful reader's. The caller passes the
result through :func:`~ckpt_tools.security.bounded.check_tree` as it does the careful one's.

A loop of its own, not fastpickle's with switches: the two know different opcodes (protocol 2's
explicit puts and text globals; protocol 4's MEMOIZE and frames) and a check per opcode is what
such a loop cannot afford; what they share (the decline, the memo's puts) is fastpickle's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .bounded import check_key
from .fastpickle import _F8, _I4, _U4, Decline, _put

__all__ = ["Decline", "Nodes", "load"]


class Nodes(NamedTuple):
    """What the careful reader calls to build what is not plain data."""

    find_class: Callable[[str, str], Any]
    persistent_load: Callable[[Any], Any]
    reduce: Callable[[Any, Any], Any]  # REDUCE: (callable, args) -> the object
    newobj: Callable[[Any, Any], Any]  # NEWOBJ: (class, args) -> the object
    build: Callable[[Any, Any], None]  # BUILD: (object, state)
    short_str: Callable[[str], str]  # a string of at most one character, kept apart


def load(buf: bytes, nodes: Nodes) -> Any:
    """The object pickled in ``buf``, exactly as the careful reader builds it from ``nodes``;
    :class:`Decline` where it cannot say."""
    try:
        return _load(buf, nodes)
    except Decline:
        raise
    except Exception as e:  # noqa: BLE001 - what the careful reader makes of it is its own to say
        raise Decline(f"{type(e).__name__}: {e}") from None


def _load(buf: bytes, nodes: Nodes) -> Any:  # noqa: C901 (one loop on purpose)
    n = len(buf)
    find_class, persistent_load, reduce, newobj, build, short_str = nodes
    memo: list[Any] = []  # puts number objects 0, 1, 2, ...: a list, as fastpickle's
    memoize = memo.append
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    append = stack.append
    if n < 3 or buf[0] != 0x80 or buf[1] != 2:
        raise Decline("not a protocol 2 pickle")
    pos = 2
    while True:
        op = buf[pos]
        # most frequent first; a put that follows a push is taken with it
        if op == 0x72:  # LONG_BINPUT (one not taken with the opcode before it)
            _put(memo, _U4(buf, pos + 1)[0], stack[-1])
            pos += 5
            continue
        if op == 0x68:  # BINGET
            append(memo[buf[pos + 1]])
            pos += 2
            continue
        if op == 0x4b:  # BININT1
            append(buf[pos + 1])
            pos += 2
            continue
        if op == 0x86 or op == 0x85 or op == 0x87:  # TUPLE2, TUPLE1, TUPLE3
            if op == 0x86:
                x = (stack[-2], stack[-1])
                del stack[-2:]
            elif op == 0x85:
                x = (stack.pop(),)
            else:
                x = (stack[-3], stack[-2], stack[-1])
                del stack[-3:]
            append(x)
            pos += 1
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x4d:  # BININT2
            append(buf[pos + 1] | buf[pos + 2] << 8)
            pos += 3
            continue
        if op == 0x28:  # MARK
            metastack.append(stack)
            stack = []
            append = stack.append
            pos += 1
            continue
        if op == 0x52:  # REDUCE
            args = stack.pop()
            stack[-1] = x = reduce(stack[-1], args)
            pos += 1
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x58:  # BINUNICODE
            end = pos + 5 + _U4(buf, pos + 1)[0]
            if end > n:
                raise Decline("truncated")
            x = str(buf[pos + 5:end], "utf-8", "surrogatepass")
            if len(x) <= 1:
                x = short_str(x)
            append(x)
            pos = end
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x74:  # TUPLE
            x = tuple(stack)
            stack = metastack.pop()
            append = stack.append
            append(x)
            pos += 1
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x81:  # NEWOBJ
            args = stack.pop()
            stack[-1] = x = newobj(stack[-1], args)
            pos += 1
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x7d:  # EMPTY_DICT
            x = {}
            append(x)
            pos += 1
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x29:  # EMPTY_TUPLE
            append(())
            pos += 1
            continue
        if op == 0x89:  # NEWFALSE
            append(False)
            pos += 1
            continue
        if op == 0x75:  # SETITEMS
            items = stack
            stack = metastack.pop()
            append = stack.append
            target = stack[-1]
            for i in range(0, len(items) - 1, 2):
                check_key(items[i])
                target[items[i]] = items[i + 1]
            pos += 1
            continue
        if op == 0x4e:  # NONE
            append(None)
            pos += 1
            continue
        if op == 0x62:  # BUILD
            state = stack.pop()
            build(stack[-1], state)
            pos += 1
            continue
        if op == 0x51:  # BINPERSID
            stack[-1] = persistent_load(stack[-1])
            pos += 1
            continue
        if op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            check_key(key)
            stack[-1][key] = value
            pos += 1
            continue
        if op == 0x71:  # BINPUT
            _put(memo, buf[pos + 1], stack[-1])
            pos += 2
            continue
        if op == 0x6a:  # LONG_BINGET
            append(memo[_U4(buf, pos + 1)[0]])
            pos += 5
            continue
        if op == 0x4a:  # BININT
            append(_I4(buf, pos + 1)[0])
            pos += 5
            continue
        if op == 0x47:  # BINFLOAT
            append(_F8(buf, pos + 1)[0])
            pos += 9
            continue
        if op == 0x88:  # NEWTRUE
            append(True)
            pos += 1
            continue
        if op == 0x5d:  # EMPTY_LIST
            x = []
            append(x)
            pos += 1
            if buf[pos] == 0x72 and _U4(buf, pos + 1)[0] == len(memo):
                memoize(x)
                pos += 5
            continue
        if op == 0x65 or op == 0x61:  # APPENDS, APPEND
            if op == 0x65:
                items = stack
                stack = metastack.pop()
                append = stack.append
            else:
                items = [stack.pop()]
            if type(stack[-1]) is not list:  # extend() or append() of another object: the careful reader's
                raise Decline("APPENDS to a non-list")
            stack[-1].extend(items)
            pos += 1
            continue
        if op == 0x8a:  # LONG1
            end = pos + 2 + buf[pos + 1]
            if end > n:
                raise Decline("truncated")
            append(int.from_bytes(buf[pos + 2:end], "little", signed=True))
            pos = end
            continue
        if op == 0x63:  # GLOBAL: two lines, as the careful reader reads them
            mid = buf.index(b"\n", pos + 1)
            end = buf.index(b"\n", mid + 1)
            append(find_class(str(buf[pos + 1:mid], "utf-8"), str(buf[mid + 1:end], "utf-8")))
            pos = end + 1
            continue
        if op == 0x64:  # DICT
            items = stack
            stack = metastack.pop()
            append = stack.append
            for k in items[::2]:
                check_key(k)
            append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})
            pos += 1
            continue
        if op == 0x6c:  # LIST
            items = stack
            stack = metastack.pop()
            append = stack.append
            append(items)
            pos += 1
            continue
        if op == 0x2e:  # STOP
            return stack.pop()
        raise Decline(f"opcode {op:#04x}")
