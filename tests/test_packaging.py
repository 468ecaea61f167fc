"""What ``pip install .`` (no ``-e``) ships: every package of the source tree.

The editable install CI uses maps the whole ``ckpt_tools`` directory, so a subpackage missing
from pyproject's explicit list still imports in tests, and only fails for users of the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_in_the_wheel():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    where = {name: ROOT / setup.get("package-dir", {}).get(name, name.replace(".", "/")) for name in listed}
    assert all((d / "__init__.py").is_file() for d in where.values()), where
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ckpt_tools").rglob("__init__.py")}
    assert on_disk <= listed, f"not shipped: {sorted(on_disk - listed)}"
