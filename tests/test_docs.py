"""Generated documentation stays in step with the data it is generated from, and the links
between README.md and docs/*.md lead somewhere."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_docs_matrix_is_generated_from_the_data() -> None:
    fresh = subprocess.run([sys.executable, "-m", "accelport", "matrix", "--markdown"], capture_output=True,
                           text=True, check=True, env={"PATH": "/usr/bin:/bin"}, timeout=120).stdout
    committed = (ROOT / "docs" / "matrix.md").read_text()
    assert fresh == committed, "docs/matrix.md is stale: run `accelport matrix --markdown > docs/matrix.md`"


def test_matrix_markdown_refuses_filters() -> None:
    out = subprocess.run([sys.executable, "-m", "accelport", "matrix", "--markdown", "--torch", "2.9"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "drop --platform and --torch" in out.stderr


PRELUDE = """
import torch
train_loader = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(60)]
Net = lambda: torch.nn.Linear(4, 1)
loss_fn = torch.nn.functional.mse_loss
"""


def test_the_torch_xla_guides_after_script_runs_unchanged_on_cpu(tmp_path: pathlib.Path) -> None:
    # The guide says the ported script runs on every backend: run its code block as written.
    text = (ROOT / "docs" / "migrate-torch-xla.md").read_text()
    after = text.split("## After", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "ap.compile_cache(" in after and "ap.save(" in after
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + after)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ACCELPORT_BACKEND": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "model.pt").is_file()
    assert "does nothing on backend 'cpu'" in out.stderr  # said once, not an error
    assert "loss" in out.stdout and "Metrics(" in out.stdout


# -- links between the pages ----------------------------------------------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code, where nothing is a link."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: pathlib.Path) -> set[str]:
    """The ids GitHub gives the headings of a page: lower case, punctuation dropped, spaces to
    hyphens, a repeated id numbered -1, -2 ..."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _relative_links(page: pathlib.Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t, flags=re.I)]  # http:, https:, mailto: ...


def test_the_pages_have_relative_links() -> None:
    # The check below can see links: the README links every docs page.
    linked = {t.split("#")[0] for t in _relative_links(ROOT / "README.md")}
    docs = {f"docs/{p.name}" for p in PAGES if p.parent.name == "docs"}
    assert docs <= linked, f"docs pages the README does not link: {sorted(docs - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_an_existing_file(page: pathlib.Path) -> None:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
