"""The dynamo surfaces the compiled-function diagnosis reads, pinned on this environment's torch (2.13).

The checks live in tests/diagnose/dynamo_surfaces.py; the xla environment runs the
same ones on torch 2.9 (tests/xla/test_dynamo_surfaces_torch29.py).
"""

from __future__ import annotations

import pytest

from tests.diagnose import dynamo_surfaces as surfaces


@pytest.mark.parametrize("check", surfaces.CHECKS)
def test_dynamo_surface(check: str) -> None:
    getattr(surfaces, check)()
