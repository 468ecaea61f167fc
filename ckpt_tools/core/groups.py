"""Where a saved state keeps its model and its optimizer, found by what they hold.

A training script saves its state under keys of its own choosing: ``{"model", "optimizer"}``,
PyTorch's DCP tutorial's ``{"model", "optim"}``, or one ``Stateful`` holding both
(``{"app": AppState}``, keys ``app.model.*`` and ``app.optim.*``). Key names are not trusted:
an optimizer state dict is a subtree holding ``state/<fqn>/<name>`` entries next to
``param_groups``, and the model is the tensor subtree whose names are those FQNs.

Everything here is pure: item paths (the nesting paths ``dcp.save`` records) in, roots out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import BadInput

# where a state saved without a recognisable optimizer keeps its model, by convention
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"


@dataclass(frozen=True)
class Roots:
    """The nesting prefix of the model's state dict and of the optimizer's (None: not found)."""

    model: tuple | None = None
    optimizer: tuple | None = None
    # a model saved under MODEL_KEY (``dcp.save({"model": sd, "rng": torch.get_rng_state()})``):
    # a tensor beside it at the top level is the job's own state, not a weight
    nested_model: bool = False

    def group_of(self, path: Sequence) -> str | None:
        """``"model"`` or ``"optimizer"`` when ``path`` lies under that root, else None."""
        path = tuple(str(p) for p in path)
        if self.optimizer is not None and len(path) > len(self.optimizer) and path[:len(self.optimizer)] == self.optimizer:
            return "optimizer"
        # a model saved at the top level (``dcp.save({**model_sd, "optimizer": ...})``) is its
        # top-level names only; under a key, all that key holds
        if self.model is not None and path[:len(self.model)] == self.model and (
                len(path) == len(self.model) + 1 if not self.model else len(path) > len(self.model)):
            return "model"
        return None

    @property
    def found(self) -> bool:
        return self.optimizer is not None


def find_roots(items: Iterable[tuple[Sequence, bool]]) -> Roots:
    """The roots of ``(path, is_tensor)`` items.

    The optimizer root is the prefix P with items ``P + ("state", fqn, name...)`` and
    ``P + ("param_groups", ...)``; the model root is the prefix of the tensors whose last
    name is one of that optimizer's FQNs (most of them, if several prefixes hold some).
    Two optimizer roots are refused: their state cannot be told apart."""
    items = [(tuple(str(p) for p in path), is_tensor) for path, is_tensor in items]
    with_groups = {path[:i] for path, _ in items for i, p in enumerate(path) if p == "param_groups"}
    fqns: dict[tuple, set[str]] = {}
    for path, is_tensor in items:
        for i, p in enumerate(path[:-2]):
            if p == "state" and path[:i] in with_groups:
                fqns.setdefault(path[:i], set()).add(path[i + 1])
    if len(fqns) > 1:
        names = sorted(".".join(root) or "(top level)" for root in fqns)
        raise BadInput(f"it holds {len(fqns)} optimizer states ({', '.join(names)}); ckpt handles one")
    if not fqns:
        return Roots(nested_model=any(t and len(p) > 1 and p[0] == MODEL_KEY for p, t in items))
    ((optimizer, names),) = fqns.items()
    counts: dict[tuple, int] = {}
    for path, is_tensor in items:
        if is_tensor and path[:len(optimizer)] != optimizer and path[-1] in names:
            counts[path[:-1]] = counts.get(path[:-1], 0) + 1
    model = max(counts, key=lambda root: (counts[root], -len(root)), default=None)
    return Roots(model=model, optimizer=optimizer)
