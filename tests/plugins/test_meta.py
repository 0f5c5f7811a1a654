"""Meta-tests, datasette-style: every hook is tested and documented."""

from __future__ import annotations

import inspect
import pathlib
import re

from accelport.plugins import hookspecs

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOOKS = sorted(n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("accelport_"))


def test_there_are_hooks() -> None:
    assert "accelport_register_backends" in HOOKS and len(HOOKS) >= 5


def test_every_hook_has_a_docstring_and_typed_parameters() -> None:
    for name in HOOKS:
        fn = getattr(hookspecs, name)
        assert fn.__doc__ and len(fn.__doc__.strip()) > 40, name
        sig = inspect.signature(fn)
        for param in sig.parameters.values():
            assert param.annotation is not inspect.Parameter.empty, f"{name}({param.name}) has no type"


def test_every_hook_is_documented_in_the_readme_or_docs() -> None:
    text = (ROOT / "README.md").read_text()
    docs = ROOT / "docs"
    if docs.is_dir():
        text += "".join(p.read_text() for p in docs.rglob("*.md"))
    missing = [h for h in HOOKS if not re.search(rf"`{h}\(", text)]
    assert not missing, f"hooks not documented with their signature: {missing}"


def test_every_hook_is_exercised_by_a_test() -> None:
    sources = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_meta.py")
    missing = [h for h in HOOKS if f"def {h}(" not in sources and f'"{h}"' not in sources]
    assert not missing, f"hooks with no test implementing or calling them: {missing}"
