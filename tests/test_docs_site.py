"""The documentation site (mkdocs.yml, docs/) builds offline with warnings as errors, and says what the code is.

Why: a link to a page that moved, an anchor that no longer exists or a page left out of the navigation is
found by `mkdocs build --strict` only if that build fails on it; the tests below build the site as .ci/run
does, then break it on purpose in a copy (a missing page, a missing anchor, a page outside the navigation)
and check that each break fails the build. The config-key page is generated from tipsito/config/schema.py
(docs/hooks/schema_page.py), so it must list every declared key. README.md stays short and links only to
pages that exist. The commands printed on the pages are parsed by tests/test_readme_commands.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tipsito.config import schema

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

pytest.importorskip("mkdocs", reason='the docs extra: pip install -e ".[docs]" (.ci/run installs it)')
pytest.importorskip("material", reason='the docs extra: pip install -e ".[docs]" (.ci/run installs it)')


def _build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
  """`python -m mkdocs build --strict` of the site at `root` into `site`, offline (no network is reachable
  from the test machines either), with the package importable for the schema hook."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NO_MKDOCS_2_WARNING="1")
  return subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("site")
  r = _build(ROOT, out)
  assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-4000:]}"
  return out


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
  """mkdocs.yml and docs/ (without the study folders under docs/results/) in a scratch folder, to break on
  purpose."""
  dst = tmp_path / "repo"
  shutil.copytree(ROOT / "docs", dst / "docs", ignore=shutil.ignore_patterns("results"))
  shutil.copy(ROOT / "mkdocs.yml", dst / "mkdocs.yml")
  # docs/results.md shows the study plots, which the copy leaves out: point them nowhere instead.
  results = dst / "docs" / "results.md"
  results.write_text(re.sub(r"!\[[^\]]*\]\(results/[^)]*\)", "", results.read_text()))
  return dst


def test_site_builds_with_every_page(site):
  nav_pages = re.findall(r":\s*([\w-]+)\.md\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
  pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
  assert sorted(nav_pages) == pages, "every docs/*.md page is in mkdocs.yml's nav, and nothing else"
  for page in pages:
    html = site / ("index.html" if page == "index" else f"{page}/index.html")
    assert html.exists(), html
  # Offline: no web font or script is fetched from a CDN when the pages are opened.
  index = (site / "index.html").read_text()
  assert "fonts.googleapis.com" not in index and "cdn.jsdelivr.net" not in index


def test_schema_page_lists_every_declared_key(site):
  html = (site / "schema" / "index.html").read_text()
  missing = [k.path for k in schema.KEYS if f"<code>{k.path}</code>" not in html]
  assert not missing, f"keys of tipsito/config/schema.py missing from the generated page: {missing}"


@pytest.mark.parametrize(
  "page, text, expected",
  [
    ("getting-started.md", "\nSee [a page that does not exist](no-such-page.md).\n", "no-such-page.md"),
    ("getting-started.md", "\nSee [Resume](training.md#no-such-section).\n", "no-such-section"),
    ("orphan.md", "# A page outside the navigation\n", "orphan.md"),
  ],
  ids=["missing-page", "missing-anchor", "page-not-in-nav"],
)
def test_a_broken_site_fails_the_strict_build(tmp_path, page, text, expected):
  repo = _copy(tmp_path)
  assert _build(repo, tmp_path / "ok").returncode == 0, "the unbroken copy builds"
  path = repo / "docs" / page
  path.write_text((path.read_text() if path.exists() else "") + text)
  r = _build(repo, tmp_path / "broken")
  assert r.returncode != 0 and expected in r.stderr, r.stderr[-2000:]


def test_readme_is_short_and_links_to_pages_that_exist():
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= README_MAX_LINES
  links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
  local = [link for link in links if not link.startswith(("http://", "https://"))]
  assert any(link.startswith("docs/") for link in local)
  missing = [link for link in local if not (ROOT / link).exists()]
  assert not missing, f"README.md links to files that do not exist: {missing}"
  # The "where next" table reaches every page of the site but the home page and the generated key list.
  linked = {pathlib.Path(link).stem for link in local if link.startswith("docs/") and link.endswith(".md")}
  pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index", "schema"}
  assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"
