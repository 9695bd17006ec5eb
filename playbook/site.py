"""The static site: chapters (markdown with result placeholders) and executed notebooks, in one reading order.

Reading order: `introduction`, the TPU `primer`, then for each step NN the chapter `chapters/NN_*.md` followed by
its executed notebook, then `conclusion`, then the results page. Every page has prev / contents / next links;
`index.html` lists them all.
"""

from __future__ import annotations

import html
import pathlib
import re
import shutil
import time
from typing import Any

from playbook import COLAB_URL, GITHUB_REPO, claims, explorer, facts
from playbook.page import Page, nav, page_html
from playbook.results import PlaceholderError, Results, Value, flatten, format_value

HERE = pathlib.Path(__file__).resolve().parent
CHAPTERS = HERE / "chapters"
FRONT = ("introduction", "primer")  # the pages before the steps, in order
SOURCE_URL = "https://github.com/{repo}/blob/main/{path}"
SOURCE = re.compile(r"\{\{\s*source:\s*([\w./\-]+)\s*\}\}")  # {{ source: qwen35_lib/parallel }}: a link to the code
RAW_TAG = re.compile(r"&lt;/?[a-zA-Z][\w-]*(?:\s[^<>]*?)?/?&gt;")  # an HTML tag escaped into the page's text


def chapter_paths() -> list[pathlib.Path]:
    """introduction.md, primer.md, the step chapters NN_*.md in order, conclusion.md."""
    steps = sorted(CHAPTERS.glob("[0-9][0-9]_*.md"))
    front = [CHAPTERS / f"{name}.md" for name in FRONT]
    return [p for p in [*front, *steps, CHAPTERS / "conclusion.md"] if p.exists()]


def markdown_title(text: str, default: str) -> str:
    match = re.search(r"^# (.+)$", text, re.M)
    return match.group(1).strip() if match else default


def reading_order(chapters: list[pathlib.Path], entries: list[dict[str, Any]]) -> list[Page]:
    """Every page of the site in reading order (index.html aside)."""
    step_chapters = {p.stem[:2]: p for p in chapters if p.stem[:2].isdigit()}
    notebooks = {e["name"][:2]: e for e in entries}

    def chapter(path: pathlib.Path) -> Page:
        step = path.stem[:2] if path.stem[:2].isdigit() else ""
        return Page(f"{path.stem}.html", markdown_title(path.read_text(), path.stem), step, source=path)

    pages = [chapter(p) for name in FRONT for p in chapters if p.stem == name]
    for step in sorted(set(step_chapters) | set(notebooks)):
        if step in step_chapters:
            pages.append(chapter(step_chapters[step]))
        if step in notebooks:
            e = notebooks[step]
            pages.append(Page(e["html"], f"Notebook {e['title'] or e['name']}", step, entry=e))
    pages += [chapter(p) for p in chapters if p.stem == "conclusion"]
    pages.append(Page("results.html", "Results of this build"))
    return pages


def render_markdown(text: str) -> str:
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    return markdown2html_mistune(text)


def link_sources(text: str) -> str:
    """`{{ source: PATH }}` -> a link to PATH in the repository on GitHub, shown as code."""
    return SOURCE.sub(lambda m: f'<a href="{SOURCE_URL.format(repo=GITHUB_REPO, path=m.group(1))}">'
                                f"<code>{html.escape(m.group(1))}</code></a>", text)


def notebook_box(step: str, entry: dict[str, Any] | None, notebooks: dict[str, str]) -> str:
    """The links under a step chapter's title: the executed notebook here, its source, Colab."""
    name = notebooks.get(step)
    if name is None:
        return '<p class="pb-box">The notebook for this step is not in this checkout yet.</p>'
    links = [f'<a href="{SOURCE_URL.format(repo=GITHUB_REPO, path=f"notebooks/{name}.py")}">source</a>',
             f'<a href="{COLAB_URL.format(repo=GITHUB_REPO, name=name)}">open in Colab</a>',
             f'<a href="{explorer.FILE}">the explorers</a>']
    if entry is None:
        run = f"<code>{name}</code> was not run in this build"
    else:
        status = ("<span class=\"pb-ok\">ran</span>" if entry["status"] == "ok"
                  else f"<span class=\"pb-failed\">failed: {html.escape(entry['error'] or '')}</span>")
        run = f'<a href="{entry["html"]}">the executed notebook <code>{name}</code></a> ({status} in ' \
              f'{entry["seconds"]:.0f} s)'
    return f'<p class="pb-box">Run it: {run} · {" · ".join(links)}</p>'


def results_body(entries: list[dict[str, Any]]) -> str:
    """Every value each notebook recorded, under the path a chapter placeholder uses to quote it."""
    parts = ["<h1>Results of this build</h1>",
             "<p>Each value below was written by its notebook during this build. A chapter quotes one as "
             "<code>{{ result: PATH }}</code>. The same data: <a href=\"results.json\">results.json</a>.</p>"]
    for e in entries:
        status = "ok" if e["status"] == "ok" else f"failed: {e['error']}"
        parts.append(f'<h2><a href="{e["html"]}">{html.escape(e["name"])}</a></h2>'
                     f"<p>{html.escape(status)}, {e['seconds']:.1f} s, {e['cells']} code cells</p>")
        recorded = (e.get("results") or {}).get(claims.CLAIMS_KEY) or {}
        if recorded:
            rows = "".join(
                f'<tr id="claim-{step_of(e)}-{html.escape(n)}"><td><code>{step_of(e)}.{html.escape(n)}</code></td>'
                f'<td>{"holds" if c.get("holds") else "<b>does not hold</b>"}</td><td>{html.escape(c.get("text", ""))}'
                f'</td><td><code>{html.escape(c.get("relation", ""))}</code></td></tr>' for n, c in recorded.items())
            parts.append("<p>Claims this notebook checked (a chapter states each as <code>{{ claim: STEP.NAME }}"
                         "</code>):</p><table><tr><th>claim</th><th>in this run</th><th>statement</th>"
                         f"<th>compared</th></tr>{rows}</table>")
        values = flatten(e.get("results") or {})
        if not values:
            parts.append("<p>No results recorded.</p>")
            continue
        step = e["name"][:2]
        rows = "".join(f"<tr><td><code>{step}.{html.escape(k)}</code></td><td>{html.escape(_full(v))}</td></tr>"
                       for k, v in values.items())
        parts.append(f"<table><tr><th>path</th><th>value</th></tr>{rows}</table>")
    return "\n".join(parts)


def step_of(entry: dict[str, Any]) -> str:
    return entry["name"][:2]


def _full(value: Any) -> str:
    """A recorded value at full precision (the chapters choose their own)."""
    if value is None:
        return "null"
    return format_value(value, ".6g" if isinstance(value, float) else None)


def index_body(pages: list[Page], build: dict[str, Any]) -> str:
    """Contents: one line per chapter, its executed notebook beside it; then how this build went."""
    items: list[str] = []
    step_items: dict[str, int] = {}
    for p in pages:
        if p.entry is None:
            step_items[p.step] = len(items)
            items.append(f'<a href="{p.file}">{html.escape(p.title)}</a>')
            continue
        ok = p.entry["status"] == "ok"
        run = (f'<a href="{p.file}">executed notebook</a> <span class="{"pb-ok" if ok else "pb-failed"}">'
               f'{"ok" if ok else "failed"}</span> ({p.entry["seconds"]:.0f} s)')
        if p.step in step_items:
            items[step_items[p.step]] += f" · {run}"
        else:
            items.append(f"{html.escape(p.title)}: {run}")
    entries = [p.entry for p in pages if p.entry is not None]
    ok = sum(e["status"] == "ok" for e in entries)
    return (f"<h1>Serving Qwen3.5-397B-A17B on TPU7x: the playbook</h1>\n"
            "<p>How to serve a 397B-parameter hybrid mixture of experts on 4 Ironwood chips, step by step, with "
            "code that runs. Each chapter frames a question; its notebook answers it, executed for this site. "
            'Start with the <a href="introduction.html">introduction</a>.</p>\n'
            f"<ol>{''.join(f'<li>{item}</li>' for item in items)}</ol>\n"
            f'<p><a href="{explorer.FILE}">{html.escape(explorer.TITLE)}</a>: the explorers, precomputed.</p>\n'
            f"<p>Built {html.escape(build['date'])} on {html.escape(build['machine'])} with Python "
            f"{build['python']} and JAX {build['jax']}: {ok} of {len(entries)} notebooks ran, at the size this "
            "hardware allows.</p>")


def add_nav_to_notebook(path: pathlib.Path, navigation: str) -> None:
    """Put the navigation bar at the top of an nbconvert page (once)."""
    text = path.read_text(encoding="utf-8")
    if 'class="pb-nav"' not in text:
        text = text.replace("</head>", '<link rel="stylesheet" href="style.css">\n</head>', 1)
        text = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + navigation, text, count=1)
        path.write_text(text, encoding="utf-8")


def raw_markup(page: str) -> list[str]:
    """HTML tags that a rendered page shows as text (escaped), e.g. a placeholder's `<span>` that landed inside a
    code span: each as the reader sees it."""
    return [html.unescape(m.group(0)) for m in RAW_TAG.finditer(page)]


def chapter_body(page: Page, results: Results, entries: list[dict[str, Any]], by_step: dict[str, str]
                 ) -> tuple[str, list[Value], str | None]:
    """A chapter's HTML with its placeholders filled, the values it quotes, and its placeholder error if any."""
    source = page.source.read_text()
    try:
        (text, values), error = results.fill(source, page.source.name), None
    except PlaceholderError as e:
        error, values = str(e), []
        text = f'<pre class="pb-missing">Results quoted here do not exist:\n{html.escape(error)}</pre>\n\n{source}'
    unbacked, _ = claims.unbacked_comparisons(source, page.source.name)
    if unbacked:
        error = "\n".join(filter(None, [error, "a box compares with no claim behind it (state it as {{ claim: "
                                         "STEP.NAME }}, checked by the notebook; playbook/claims.py):",
                                         *unbacked]))
    body = render_markdown(link_sources(text))
    if page.step:
        entry = next((e for e in entries if e["name"][:2] == page.step), None)
        body = body.replace("</h1>", "</h1>" + notebook_box(page.step, entry, by_step), 1)
    return body, values, error


BUILD_STEP = "build"  # the introduction quotes how this build went: {{ result: build.slowest_seconds | .0f }}


def build_facts(entries: list[dict[str, Any]], build: dict[str, Any]) -> dict[str, dict]:
    """{BUILD_STEP: {"run": ...}}: what the builder measured of this build's notebooks (seconds each, the slowest,
    the total) and the machine; empty when no notebook ran (a chapter quoting it then shows it missing)."""
    if not entries:
        return {}
    seconds = {e["name"]: e["seconds"] for e in entries}
    slowest = max(seconds, key=seconds.get)
    return {BUILD_STEP: dict(run=dict(seconds=seconds, slowest=slowest, slowest_seconds=seconds[slowest],
                                      total_seconds=sum(seconds.values()), notebooks=len(entries),
                                      ok=sum(e["status"] == "ok" for e in entries), machine=build["machine"]))}


def write_site(out: pathlib.Path, entries: list[dict[str, Any]], build: dict[str, Any],
               notebooks: list[str]) -> tuple[list[Value], list[str]]:
    """Write every page under `out`; return the conclusion's values (the key results) and placeholder errors.

    `notebooks` names the notebooks of the checkout (run in this build or not), `entries` those that ran; their
    pages `<out>/<entry["html"]>` exist already and get the navigation bar.
    """
    pages = reading_order(chapter_paths(), entries)
    results = Results(entries, {p.step for p in pages if p.step} | {n[:2] for n in notebooks} | {BUILD_STEP},
                      facts={facts.STEP: facts.documents(), **build_facts(entries, build)})
    by_step = {n[:2]: n for n in notebooks}
    key_values: list[Value] = []
    errors: list[str] = []
    shutil.copy(HERE / "templates" / "style.css", out / "style.css")
    explorer.write_page(out)  # explorer.html: the library's numbers on a grid, controls without a kernel
    for i, page in enumerate(pages):
        if page.entry is not None:
            add_nav_to_notebook(out / page.file, nav(pages, i))
            continue
        if page.source is None:
            body = results_body(entries)
        else:
            body, values, error = chapter_body(page, results, entries, by_step)
            errors += [error] if error else []
            raw = raw_markup(body)
            if raw:
                errors.append(f"{page.source.name}: HTML shown as text (a placeholder inside `code`?): {raw[:3]}")
            key_values = values if page.source.stem == "conclusion" else key_values
        out.joinpath(page.file).write_text(page_html(page.title, body, nav(pages, i)), encoding="utf-8")
    out.joinpath("index.html").write_text(
        page_html("Contents", index_body(pages, build), nav([Page("index.html", "Contents"), *pages], 0)),
        encoding="utf-8")
    return key_values, errors


def build_info(python: str, jax: str, machine: str) -> dict[str, Any]:
    return dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), python=python, jax=jax, machine=machine)
