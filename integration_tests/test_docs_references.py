"""References in code and docs resolve inside the repository (issue #30 item 5).

- Every `docs/design.md §N` (or §N.M) names a numbered section of docs/design.md, and docs/design.md's
  own § references do too.
- No file refers to a design document outside the repository (the design lives in docs/design.md).
- Every relative markdown link in the repository's .md files names an existing file, and its
  #anchor, when it has one, a heading of that file (GitHub's slugs).

Pure text: no package is imported, so the test takes well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SKIP_DIRS = {".git", ".venv", ".nox", "vendor", "dist", "build", "node_modules", "__pycache__", ".pytest_cache",
             ".mypy_cache", ".ruff_cache"}
TEXT_SUFFIXES = {".py", ".pyx", ".pxd", ".md", ".toml", ".sh", ".cfg", ".txt", ".yml", ".yaml", ".json", ""}
# Spelled in pieces so that this file does not match its own check.
EXTERNAL_DESIGN_DOCS = ("DESIGN" + ".md", "STYLE" + ".md", "/work/" + "shared")

_SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)")
_DESIGN_REF = re.compile(r"design\.md[)`]?((?:(?:\s|,|;|and|or|–|-)*§\s?\d+(?:\.\d+)*)+)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _text_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in path.relative_to(ROOT).parts):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES and path.stat().st_size < 2_000_000:
            try:
                files.append((path, path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue
    return files


FILES = _text_files()
MARKDOWN = [(path, text) for path, text in FILES if path.suffix == ".md"]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def design_sections() -> set[str]:
    """Section numbers of docs/design.md's numbered headings ("## 3. ...", "### 3.1 ...")."""
    sections = set()
    for _, line in _prose_lines(DESIGN.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match and (number := re.match(r"(\d+(?:\.\d+)*)\.?\s", match.group(2))):
            sections.add(number.group(1))
    return sections


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)        # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def test_design_has_numbered_sections() -> None:
    sections = design_sections()
    assert {str(n) for n in range(1, 15)} <= sections, sorted(sections)


def test_every_design_reference_names_a_section() -> None:
    sections = design_sections()
    bad = []
    for path, text in FILES:
        for match in _DESIGN_REF.finditer(text):
            for number in _SECTION.findall(match.group(1)):
                if number not in sections:
                    line = text.count("\n", 0, match.start()) + 1
                    bad.append(f"{path.relative_to(ROOT)}:{line}: design.md §{number}")
    for number in _SECTION.findall(DESIGN.read_text(encoding="utf-8")):
        if number not in sections:
            bad.append(f"docs/design.md: §{number}")
    assert not bad, "references to sections docs/design.md does not have:\n" + "\n".join(bad)


def test_no_file_refers_to_a_design_document_outside_the_repository() -> None:
    bad = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, text.index(name)) + 1}: {name}"
           for path, text in FILES for name in EXTERNAL_DESIGN_DOCS if name in text]
    assert not bad, "the design is docs/design.md; these point elsewhere:\n" + "\n".join(bad)


def test_relative_markdown_links_resolve() -> None:
    bad = []
    for path, text in MARKDOWN:
        for number, line in _prose_lines(text):
            for target in _LINK.findall(line.replace("``", "")):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
                    continue                    # a URL (https:, mailto:) or an absolute path
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{number}: ({target})"
                if not linked.exists():
                    bad.append(f"{where} -> no such file")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    bad.append(f"{where} -> no heading with that anchor")
    assert not bad, "broken relative links:\n" + "\n".join(bad)


@pytest.mark.parametrize(("heading", "slug"), [
    ("Prefill (8K prompt)", "prefill-8k-prompt"),
    ("3.1 The step-kind vote", "31-the-step-kind-vote"),
    ("`EngineArgs` and **flags**", "engineargs-and-flags"),
])
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug
