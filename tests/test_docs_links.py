"""Every relative link in README.md and docs/ (the log included) names a file that exists, and an anchor that
one of its headings makes (GitHub's rule: lower case, punctuation dropped, spaces to hyphens, repeats
numbered). Pure file reading."""
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))


def prose(text: str, code: bool = False) -> Iterator[str]:
    """The page's lines outside fenced code; inline code blanked out unless code."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line if code else re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose(path.read_text(encoding="utf-8"), code=True):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> Iterator[str]:
    for line in prose(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            yield m.group(1)


def broken(path: Path) -> Iterator[str]:
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            yield f"{target}: no such file"
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            yield f"{target}: no heading makes #{anchor}"


@pytest.mark.parametrize("page", list(pages()), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    assert list(broken(page)) == []


def test_slug_follows_github() -> None:
    heading = "The HTTP path: Serve's proxy, direct ingress, HAProxy"
    assert slug(heading) == "the-http-path-serves-proxy-direct-ingress-haproxy"
    assert slug("One K/V buffer for all slots (`kv_unified`)") == "one-kv-buffer-for-all-slots-kv_unified"
