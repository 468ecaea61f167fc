"""The README stays a first hour's read and the docs keep up with the CLI: every flag of every
command is in docs/cli.md, every page under docs/ is linked from the README, every relative link
leads to a file, and the install and test commands CI runs are the README's."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from ckpt_tools.cli.main import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# pages other branches write; linked already, checked once they are here
PENDING: set[str] = set()  # pages linked before they are written
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short_and_keeps_install_and_test() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "## Install" in text and "## Test" in text
    assert "HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider" in text.split("## Test", 1)[1]
    assert "--index-url https://download.pytorch.org/whl/cpu" in text.split("## Install", 1)[1].split("## Test")[0]
    ci = (REPO / ".ci" / "run").read_text()
    for line in ci.splitlines():
        if line.startswith("python -m pip install \"torch") or line.startswith("DS_BUILD_OPS"):
            assert line in text, line


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {Path(m).name for m in LINK.findall(README.read_text()) if m.startswith("docs/")}
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= linked, pages - linked


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if "://" in target or Path(target).name in PENDING:
            continue
        assert (page.parent / target).exists(), f"{page.name}: {target}"
    assert "CONTRACT.md" not in page.read_text()


@pytest.mark.parametrize("name", sorted(main.commands))
def test_cli_page_has_every_command_and_flag(name: str) -> None:
    text = (DOCS / "cli.md").read_text()
    assert f"## `{name}" in text, name
    for param in main.commands[name].params:
        if isinstance(param, click.Option):
            assert any(opt in text for opt in param.opts), f"{name}: {param.opts}"
