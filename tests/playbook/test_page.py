"""playbook.page: the previous / contents / next navigation of a page, and the page template."""

from playbook.page import Page, nav, page_html

PAGES = [Page("index.html", "Contents"), Page("00_a.html", "A & B"), Page("01_b.html", "Next")]


def test_nav_links_the_neighbours_and_leaves_an_empty_slot_at_the_ends():
    middle = nav(PAGES, 1)
    assert '<span class="pb-prev"><a href="index.html">← Contents</a></span>' in middle
    assert '<span class="pb-next"><a href="01_b.html">Next →</a></span>' in middle
    assert '<span class="pb-next"></span>' in nav(PAGES, 2) and '<span class="pb-prev"></span>' in nav(PAGES, 0)
    assert "A &amp; B →" in nav(PAGES, 0)  # titles escaped


def test_page_html_escapes_the_title_and_keeps_the_body():
    page = page_html("1 < 2", "<p>body</p>", nav(PAGES, 1))
    assert "1 &lt; 2" in page and "<p>body</p>" in page and 'class="pb-nav"' in page
