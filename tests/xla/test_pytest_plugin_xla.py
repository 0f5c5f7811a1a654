"""The pytest plugin in the xla environment: cpu and xla cases of one test share a pytest process.

torch's autograd engine sizes its device queues at the process's first backward pass; a
torch_xla device started after a CPU backward failed every backward of its own (an internal
assert about ``device_ready_queues_``), so ``ap_backend``'s ``[xla]`` case failed after the
``[cpu]`` case. Each run is a fresh pytest process, as a user's is: torch_xla's runtime is
already up in this one.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla
pytest_plugins = ["pytester"]

BACKWARD_ON_EACH = """
import pytest
import torch
import accelport as ap

def backward_on(device):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    model(torch.randn(8, 4).to(device)).pow(2).mean().backward()
    ap.sync()
    grad = model.weight.grad.cpu()
    assert grad.shape == (1, 4) and bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0)

def test_a_plain_backward_on_the_cpu_first():
    backward_on("cpu")  # no accelport: a test of the suite that runs before the plugin's

@pytest.mark.accelport(backends={order})
def test_each(ap_backend):
    assert ap.device().type == {{"cpu": "cpu", "xla": "xla"}}[ap_backend.name]
    backward_on(ap.device())
"""


@pytest.mark.parametrize("order", [["cpu", "xla"], ["xla", "cpu"]], ids=["cpu-first", "xla-first"])
def test_cpu_and_xla_cases_both_run_a_backward_in_one_session(pytester: pytest.Pytester,
                                                               order: list[str]) -> None:
    pytester.makepyfile(BACKWARD_ON_EACH.format(order=order))
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_a_plain_backward_on_the_cpu_first PASSED*",
                                 f"*test_each?{order[0]}? PASSED*", f"*test_each?{order[1]}? PASSED*"])
