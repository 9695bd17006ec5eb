"""One page of the site: its record in the reading order, its navigation bar, and the HTML around its body.

Shared by the site builder (`playbook.site`) and the explorers' page (`playbook.explorer`), which it builds.
"""

from __future__ import annotations

import dataclasses
import html
import pathlib
import string
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
TEMPLATE = string.Template((HERE / "templates" / "page.html").read_text())


@dataclasses.dataclass
class Page:
    file: str  # the page's file name in the site
    title: str
    step: str = ""  # "00".."06" for a step's chapter and notebook pages
    source: pathlib.Path | None = None  # a chapter's markdown
    entry: dict[str, Any] | None = None  # a notebook's entry of results.json


def nav(pages: list[Page], i: int) -> str:
    def link(j: int, cls: str, arrow: str) -> str:
        if not 0 <= j < len(pages):
            return f'<span class="{cls}"></span>'
        text = f"{arrow} {pages[j].title}" if arrow == "←" else f"{pages[j].title} {arrow}"
        return f'<span class="{cls}"><a href="{pages[j].file}">{html.escape(text)}</a></span>'

    return (f'<nav class="pb-nav">{link(i - 1, "pb-prev", "←")}<a href="index.html">Contents</a>'
            f'{link(i + 1, "pb-next", "→")}</nav>')


def page_html(title: str, body: str, navigation: str) -> str:
    return TEMPLATE.substitute(title=html.escape(title), nav=navigation, body=body)
