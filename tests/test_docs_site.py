"""The documentation site builds strictly from the sources and reads as a user sees it.

- ``sphinx-build -W`` over ``docs/`` (as ``make docs``): a broken link or anchor, a page in no
  table of contents, a bad docstring or a generator error fails the build;
- the generated references hold every configuration key and every command, and no page writes
  a key's description by hand (``test_no_page_describes_keys_by_hand``);
- every error message the troubleshooting page quotes is one the code really raises;
- a headless Chromium (Playwright, the system's browser) opens the built site over HTTP and
  checks the landing page, search, a math page and the configuration reference render with no
  console error. ``OTBRL_DOCS_SHOTS=DIR`` keeps its screenshots there.
"""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SPHINX = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html"]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as ``make docs`` builds it (fresh environment, warnings are errors)."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [*SPHINX, "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"the site does not build strictly:\n{done.stderr[-6000:]}"
    return out


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_every_config_key_is_in_the_generated_reference(site):
    from otbrl.config.describe import key_comments
    from otbrl.config.schema import all_keys

    page = (site / "reference-config.html").read_text()
    rows = re.findall(r"<tr[^>]*>\s*<td[^>]*><p><code[^>]*><span[^>]*>([\w.]+)</span>", page)
    assert sorted(rows) == sorted(all_keys()), "the reference is not every key, once"
    text = re.sub(r"\s+", " ", _text(page))
    for key, note in key_comments().items():
        words = re.sub(r"\s+", " ", note)[:30]
        assert re.sub(r"[\"'`]", "", words) in re.sub(r"[\"'`“”‘’]", "", text), key


def test_every_command_is_in_the_cli_reference(site):
    from otbrl import cli

    page = _text((site / "reference-cli.html").read_text())
    parser = cli._build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in commands:
        assert f"usage: otbrl {name}" in page, f"otbrl {name} is missing from the CLI reference"
    assert "--print-config" in page and "--estimators" in page and "--arms" in page


KEY_ROW = re.compile(r"^\|\s*`?([a-z_]+\.[a-z_.]+)`?\s*\|", re.M)


def test_no_page_describes_keys_by_hand():
    """A table whose rows start with configuration keys is the generated reference's job:
    a second, hand-written copy drifts from the code."""
    from otbrl.config.schema import all_keys

    keys = set(all_keys())
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        rows = [k for k in KEY_ROW.findall(path.read_text()) if k in keys]
        assert len(rows) < 3, (
            f"{path.relative_to(ROOT)} has a hand-written table of configuration keys "
            f"({', '.join(rows[:5])}, ...): link to reference-config.md instead"
        )


# keys a page names on purpose although they are not keys today: renamed or removed ones, whose
# messages the page shows, and the other frameworks' keys of the plug-in pages
NOT_KEYS = {"actor.engine", "model.dtype"}
NAMED_KEY = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)")


def test_every_key_a_page_names_exists():
    """A dotted name in backticks whose first part is a configuration group is a key, or a
    group of keys: ``algorithm.otb.handle_zero_tail`` (the key is ``algorithm.handle_zero_tail``)
    sat in the configuration guide, and a user who typed it got an unknown-key error."""
    from omegaconf import DictConfig, OmegaConf

    from otbrl.config.schema import Config, all_keys

    keys = set(all_keys())
    groups = {k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1)}
    schema = OmegaConf.structured(Config)
    # a key whose value is a mapping (data.task_options): the names under it are its entries
    mappings = tuple(f"{k}." for k in keys if isinstance(OmegaConf.select(schema, k), DictConfig))
    tops = {k.split(".")[0] for k in keys}
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    history = {"changelog.md", "performance-history.md", "integrations.md", "architecture.md"}
    for path in pages:
        if path.name in history:  # the past's keys, verl's and TRL's, module paths
            continue
        for name in NAMED_KEY.findall(path.read_text()):
            if (
                name.split(".")[0] in tops
                and name not in NOT_KEYS
                and not name.startswith(mappings)
            ):
                assert name in keys or name in groups, f"{path.name} names no key: {name}"


def test_troubleshooting_quotes_real_errors():
    """Each message the page quotes (a ``> `` line) occurs in the source as written, string
    literals split over lines joined: an error reworded in the code fails here."""
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "otbrl").rglob("*.py"))
    joined = re.sub(r"[\"']\s*\n\s*(?:rf|fr|f|r)?[\"']", "", source)
    quotes = [
        line[2:].strip()
        for line in (DOCS / "troubleshooting.md").read_text().splitlines()
        if line.startswith("> ")
    ]
    assert len(quotes) >= 20, "the troubleshooting page quotes fewer than 20 errors"
    for quote in quotes:
        text = quote.strip("`").strip()
        assert len(text) >= 20, f"quote too short to find: {quote!r}"
        assert text in joined, f"troubleshooting.md quotes an error no code raises: {text!r}"


def _browser() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _pages_with_display_math(site: Path) -> list[str]:
    names = [p.name for p in sorted(site.glob("*.html")) if 'class="math-block"' in p.read_text()]
    assert "concepts-otb.html" in names, names
    return names


def test_the_site_renders_in_a_real_browser(site, served, tmp_path):
    executable = _browser()
    if executable is None:
        # CI installs Debian's chromium (make test): there a missing browser is a failure
        assert not os.environ.get("CI"), "no Chromium on CI: `make test` installs it"
        pytest.skip("no Chromium here (`apt-get install chromium`)")
    playwright = pytest.importorskip("playwright.sync_api")
    from otbrl.config.schema import all_keys

    shots = Path(os.environ.get("OTBRL_DOCS_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on(
            "console",
            lambda m: errors.append(f"{page.url}: {m.text}") if m.type == "error" else None,
        )
        page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
        # a request the browser cancels because the test moves on (net::ERR_ABORTED: a favicon
        # or a search summary still loading, on a busy machine) is not the site's failure
        page.on(
            "requestfailed",
            lambda r: (
                None
                if r.failure == "net::ERR_ABORTED"
                else errors.append(f"{page.url}: failed {r.url} ({r.failure})")
            ),
        )

        page.goto(f"{served}/index.html")
        assert page.title().startswith("otbrl")
        nav = page.locator(".sidebar-tree a.reference")
        assert nav.count() >= 20, "the sidebar lists fewer pages than the site has"
        assert page.locator("article h1").first.is_visible()
        page.screenshot(path=shots / "landing.png")

        # search: Sphinx's index, loaded by its own script, finds a page by a word in it
        page.goto(f"{served}/search.html?q=sandbox")
        page.wait_for_selector("#search-results ul.search li", timeout=15_000)
        hits = page.locator("#search-results ul.search li a").all_inner_texts()
        assert any("sandbox" in h.lower() for h in hits), hits
        # the results' summaries are fetched from their pages after the list shows: leaving
        # before they arrive aborts them (requests "failed" on a busy machine)
        page.wait_for_load_state("networkidle", timeout=30_000)
        page.screenshot(path=shots / "search.png")

        # math: MathML drawn by the browser, with a real size (not raw TeX)
        page.goto(f"{served}/concepts-otb.html")
        block = page.locator("div.math-block math").first
        box = block.bounding_box()
        assert box is not None and box["height"] > 15 and box["width"] > 60, box
        assert "\\sum" not in page.locator("article").inner_text()
        page.screenshot(path=shots / "math.png")
        # issue 53: each display equation's box overflowed vertically (a scrollbar beside every
        # formula): a block may scroll sideways when too wide, never up and down
        for name in _pages_with_display_math(site):
            page.goto(f"{served}/{name}")
            overflowing = page.eval_on_selector_all(
                "div.math-block",
                "blocks => blocks.filter(b => b.scrollHeight > b.clientHeight)"
                ".map(b => [b.scrollHeight, b.clientHeight, b.textContent.slice(0, 40)])",
            )
            assert not overflowing, (name, overflowing)

        page.goto(f"{served}/reference-config.html")
        rows = page.locator("article table tbody tr")
        assert rows.count() == len(all_keys())
        assert rows.first.is_visible()
        page.screenshot(path=shots / "config-reference.png")
        browser.close()
    assert not errors, "\n".join(errors)
