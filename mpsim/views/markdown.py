"""The markdown that ``mpsim reproduce`` writes, as HTML: headings, tables, images (read
from the report's folder and inlined), code and paragraphs; all text escaped, no link
followed."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from mpsim.views.html import esc, page, pre_html, table_html


def _inline_image(folder: Path, alt: str, name: str) -> str:
    path = folder / name
    if ":" in name or not path.is_file():
        return f"<p class=\"note\">[{esc(alt)}: {esc(name)} not found]</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    kind = "svg+xml" if path.suffix == ".svg" else "png"
    return f"<p><img alt=\"{esc(alt)}\" src=\"data:image/{kind};base64,{data}\" style=\"max-width:100%\"></p>"


def _md_table(lines: list[str]) -> str:
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    body = [row for row in cells[1:] if not all(set(c) <= set("-: ") for c in row)]
    return table_html(cells[0], body)


def markdown_html(text: str, folder: Path) -> str:
    """The markdown ``reproduce`` writes (headings, tables, images, code, paragraphs) as
    HTML, images read from ``folder`` and inlined; all text escaped, no link followed."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            out.append(pre_html("\n".join(lines[i + 1:end])))
            i = end + 1
            continue
        if line.lstrip().startswith("|"):
            end = next((j for j in range(i, len(lines)) if not lines[j].lstrip().startswith("|")), len(lines))
            out.append(_md_table(lines[i:end]))
            i = end
            continue
        if m := re.fullmatch(r"(#{1,6})\s+(.*)", line):
            level = min(len(m.group(1)) + 1, 6)
            out.append(f"<h{level}>{esc(m.group(2))}</h{level}>")
        elif m := re.fullmatch(r"\s*!\[([^\]]*)\]\(([^)]+)\)\s*", line):
            out.append(_inline_image(folder, m.group(1), m.group(2)))
        elif line.strip():
            out.append(f"<p>{esc(line)}</p>")
        i += 1
    return "\n".join(out)


def reproduce_page(names: list[str], texts: list[str], folder: Path) -> str:
    """The HTML file of ``mpsim reproduce --html``: every paper's report, images inlined."""
    return page("mpsim reproduce: " + ", ".join(names), [markdown_html(t, folder) for t in texts])
