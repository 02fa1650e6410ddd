"""Every relative markdown link in the README, docs/, bench/ and the role READMEs names a file that exists and, with
an anchor, a heading of that file (GitHub's slugs): the benchmarks reference links each figure to its evidence in
the lab log, and a renamed heading must not leave a figure without it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s#]*\.md)?(?:#([^)\s]+))?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slugs(md: Path) -> set[str]:
    """The anchors GitHub gives the headings of `md` (fenced code skipped; a repeated slug gets -1, -2, ...)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))
        slug = re.sub(r"[^\w\- ]", "", text.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "roles").rglob("README.md"))]
    found += [p for p in sorted((ROOT / "bench").rglob("*")) if p.is_file() and p.suffix in {".md", ".py", ".sh"}]
    return [p for p in found if p.is_file()]


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target, anchor in LINK.findall(doc.read_text(encoding="utf-8")):
        if (not target and not anchor) or target.startswith(("http:", "https:")):
            continue
        dest = doc.parent / target if target else doc
        if not dest.is_file():
            bad.append(f"{doc.relative_to(ROOT)}: no file {target}")
        elif anchor and anchor not in slugs(dest):
            bad.append(f"{doc.relative_to(ROOT)}: {target}#{anchor} names no heading")
    return bad


def test_every_relative_link_resolves() -> None:
    docs = documents()
    assert len(docs) > 20  # the README, docs/, bench/ and the role READMEs were found
    assert [bad for doc in docs for bad in broken_links(doc)] == []


def test_a_link_to_a_missing_heading_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## A `code` heading, with: punctuation\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#a-code-heading-with-punctuation) [ok](a.md#twice-1) [bad](a.md#nowhere) "
                   "[gone](c.md)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(doc) == ["b.md: a.md#nowhere names no heading", "b.md: no file c.md"]
    finally:
        ROOT = saved
