"""Every relative link in the repository's Markdown names a file or folder the repository
holds: a results folder the docs quote but .gitignore kept out is a link to nothing in
every clone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# [text](target) or [text](target#anchor); the target without spaces or a scheme.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def tracked() -> set[PurePosixPath]:
    """The files git holds, and every folder above them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    files = {PurePosixPath(name) for name in listed.split("\0") if name}
    return files | {parent for name in files for parent in name.parents}


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def resolve(document: PurePosixPath, target: str) -> PurePosixPath:
    """The repository path `target` names from `document`, `..` folded."""
    parts: list[str] = []
    for part in (document.parent / target).parts:
        if part == ".." and parts and parts[-1] != "..":
            parts.pop()
        elif part != ".":
            parts.append(part)  # a ".." left at the front is above the root: never tracked
    return PurePosixPath(*parts)


def test_relative_links_are_found_and_resolved() -> None:
    text = "see [a](../x/y.md#part), [b](https://kafka.apache.org), [c](results/r/), [d](#top)"
    assert relative_links(text) == ["../x/y.md", "results/r/"]
    assert resolve(PurePosixPath("docs/results.md"), "../x/y.md") == PurePosixPath("x/y.md")
    assert resolve(PurePosixPath("README.md"), "../outside") == PurePosixPath("../outside")
    assert resolve(PurePosixPath("README.md"), "../../x") == PurePosixPath("../../x")
    assert resolve(PurePosixPath("a/b.md"), "./c/../d") == PurePosixPath("a/d")


def test_every_relative_link_names_a_tracked_path() -> None:
    paths = tracked()
    documents = sorted(p for p in paths if p.suffix == ".md")
    assert PurePosixPath("README.md") in documents
    broken = [
        f"{document}: {target}"
        for document in documents
        for target in relative_links((ROOT / document).read_text(encoding="utf-8"))
        if resolve(document, target) not in paths
    ]
    assert broken == [], "\n".join(broken)
