"""The README stays a short manual, and every relative link in the docs leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import ROOT

README_MAX_BYTES = 13_000
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)")
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(markdown: str) -> list[str]:
    """Link targets that are paths in this repository: no scheme, no mail address, no bare anchor."""
    without_code = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    targets = LINK.findall(without_code)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_readme_is_at_most_about_12_kb() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move depth to docs/ (limit {README_MAX_BYTES})"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(page: Path) -> None:
    broken = [t for t in relative_links(page.read_text()) if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_the_link_finder_sees_links_and_skips_urls_and_anchors() -> None:
    text = "[a](docs/x.md#y) ![b](img.png) [c](https://e.org) [d](#here)\n```\n[e](not/a/link.md)\n```"
    assert relative_links(text) == ["docs/x.md#y", "img.png"]
