"""`import accelport` stays light: no torch, no vendor runtime."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "torch_xla", "torch_tpu", "torch_neuronx", "numpy", "libneuronxla")


def _loaded_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys, json\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_accelport_loads_no_torch_or_vendor_library() -> None:
    assert _loaded_after("import accelport") == []


def test_listing_backends_loads_no_torch_or_vendor_library() -> None:
    assert _loaded_after("import accelport; accelport.backends()") == []


def test_cli_backends_loads_no_torch() -> None:
    assert _loaded_after("from accelport.cli import main; main(['backends', '--json'])") == []


def test_using_a_backend_imports_torch() -> None:
    # The control for the tests above: the probe really does see torch arrive.
    assert "torch" in _loaded_after("import accelport; accelport.device()")


def test_public_functions_are_not_shadowed_by_submodules() -> None:
    # Importing a submodule binds it as an attribute of the package: a submodule
    # named like a public function (accelport.loader vs ap.loader) would replace it.
    import importlib
    import inspect
    import pkgutil

    import accelport

    functions = [n for n in accelport.__all__ if inspect.isfunction(getattr(accelport, n))]
    assert len(functions) > 10, "the public API lost its functions"
    for mod in pkgutil.iter_modules(accelport.__path__):
        if mod.name != "__main__":
            importlib.import_module(f"accelport.{mod.name}")
    for name in functions:
        assert inspect.isfunction(getattr(accelport, name)), f"accelport.{name} is shadowed"


def test_import_accelport_loads_only_what_it_needs() -> None:
    # What `import accelport` adds to the interpreter: its errors module, nothing heavy.
    # pluggy, dataclasses, inspect, tempfile and socket arrive with the first ap.* call that needs them.
    probe = ("import sys\nbefore = set(sys.modules)\nimport accelport\n"
             "print(' '.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    added = set(out.stdout.split())
    assert {m for m in added if m.startswith("accelport")} == {"accelport", "accelport.errors"}
    assert not added & {"pluggy", "dataclasses", "inspect", "tempfile", "socket", "packaging", "json"}, added
