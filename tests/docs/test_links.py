"""Every relative link in README.md and docs/ (and the other READMEs they lead to) resolves: the file exists in the
checkout, and a `#fragment` names a heading of the page it points at."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def pages(repo: Path = REPO) -> list[Path]:
    """README.md, every page under docs/ (not installed packages), and the READMEs beside the code."""
    found = [repo / "README.md", repo / "deploy" / "README.md", repo / "hami-core" / "README.md"]
    found += [p for p in sorted((repo / "docs").rglob("*.md")) if "node_modules" not in p.parts]
    return [p for p in found if p.is_file()]


def prose(markdown: str) -> str:
    """The text with code blocks and code spans removed: a link written inside code is not a link."""
    return _CODE.sub("", _FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every fragment a page answers to, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set(_HTML_ANCHOR.findall(markdown))
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(markdown: str) -> list[str]:
    text = prose(markdown)
    return _INLINE.findall(text) + _DEFINITION.findall(text)


def broken_links(page: Path, repo: Path = REPO) -> list[str]:
    """Each relative link of `page` that leads nowhere, with the reason."""
    problems = []
    for target in links(page.read_text()):
        if _SCHEME.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
        if not resolved.is_relative_to(repo.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
            problems.append(f"{target}: no heading #{fragment} in {resolved.relative_to(repo.resolve())}")
    return problems


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    checked = pages()
    assert REPO / "README.md" in checked and len(checked) > 5, checked
    problems = {p.relative_to(REPO).as_posix(): broken_links(p) for p in checked}
    problems = {page: found for page, found in problems.items() if found}
    assert not problems, "broken links:\n" + "\n".join(f"{page}: {p}" for page, found in problems.items() for p in found)


def test_the_readme_links_every_docs_page() -> None:
    readme = {(REPO / t.partition("#")[0]).resolve() for t in links((REPO / "README.md").read_text()) if not _SCHEME.match(t)}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in readme]
    assert not unlinked, f"README.md links none of: {', '.join(unlinked)}"


def test_the_checker_finds_a_missing_file_a_missing_heading_and_a_way_out(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The enforcer: `bench/enforcer.py`\n\n## Same\n\n## Same\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#the-enforcer-benchenforcerpy) [second](other.md#same-1) [self](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [escape](../../outside.md)\n"
        "`[in code](missing-too.md)`\n\n```\n[in a block](missing-three.md)\n```\n\n[ref]: also-missing.md\n")
    assert sorted(broken_links(page, tmp_path)) == sorted([
        "missing.md: no such file", "other.md#nowhere: no heading #nowhere in docs/other.md",
        "../../outside.md: outside the repository", "also-missing.md: no such file"])
