"""The playground file itself, without a browser: it is self-contained (nothing is fetched from
elsewhere, so the server works offline), every control is labelled, and the tabs are wired.
The behaviour of each mode is tested in headless Chromium (test_playground.py)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from omni_server.serve.app import STATIC_DIR

PAGE = STATIC_DIR / "index.html"
CONTROLS = {"input", "select", "textarea"}


class _Page(HTMLParser):
    """Elements by id, the open-tag stack's labels, and every URL-bearing attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, tuple[str, dict[str, str | None]]] = {}
        self.urls: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.unlabelled: list[str] = []
        self.label_for: set[str] = set()
        self._open: list[str] = []
        self._controls_in_labels: set[str] = set()
        self._controls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids[found["id"] or ""] = (tag, found)
        for name in ("src", "href", "action", "data"):
            if found.get(name):
                self.urls.append((tag, name, found[name] or ""))
        if tag == "label" and found.get("for"):
            self.label_for.add(found["for"] or "")
        if tag in CONTROLS:
            ident = found.get("id") or f"<{tag} without id>"
            self._controls.append(ident)
            if "label" in self._open:
                self._controls_in_labels.add(ident)
        if tag not in {"input", "meta", "br", "img", "link"}:
            self._open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._open:
            while self._open.pop() != tag:
                pass

    def unlabelled_controls(self) -> list[str]:
        return [c for c in self._controls if c not in self._controls_in_labels | self.label_for]


def _page() -> tuple[_Page, str]:
    text = PAGE.read_text()
    parsed = _Page()
    parsed.feed(text)
    return parsed, text


def test_the_page_fetches_nothing_from_elsewhere() -> None:
    parsed, text = _page()
    assert not [u for u in parsed.urls if u[0] in ("script", "link", "img", "iframe")]
    assert not re.search(r"""\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", text)
    script = text[text.index("<script>") : text.index("</script>")]
    # the API is called relative to the page (same origin), never by an absolute URL
    assert not re.search(r"""fetch\(\s*["'`](?:https?:|/)""", script)
    assert "import " not in script and "@import" not in text


def test_every_control_has_a_label() -> None:
    parsed, _ = _page()
    assert parsed.unlabelled_controls() == []


def test_each_tab_controls_its_panel() -> None:
    parsed, _ = _page()
    tabs = {i: a for i, (tag, a) in parsed.ids.items() if a.get("role") == "tab"}
    assert sorted(tabs) == ["tab-chat", "tab-speak", "tab-talk", "tab-transcribe"]
    for tab_id, attrs in tabs.items():
        panel_id = attrs["aria-controls"] or ""
        assert panel_id == tab_id.replace("tab-", "panel-")
        _, panel = parsed.ids[panel_id]
        assert panel.get("role") == "tabpanel" and panel.get("aria-labelledby") == tab_id
