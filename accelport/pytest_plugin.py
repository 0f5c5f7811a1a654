"""pytest plugin: run one test suite on a laptop, a CPU runner, a TPU VM and a Trainium host.

Installed with accelport (entry point ``pytest11``, name ``accelport``) and idle
until a project uses it: nothing is probed, selected or imported unless a test
carries the marker, requests the fixture, or the option is given.

- ``pytest --accelport-backend tpu``: every test in the session runs on ``tpu``
  (``ACCELPORT_BACKEND`` is set for the session, so subprocesses follow). An
  unknown name or a backend that cannot run here is a usage error.
- ``@pytest.mark.accelport(backends=["xla", "tpu"], min_devices=1)``: the test
  runs on the first listed backend that can run here with that many devices,
  and is skipped with the backends' probe reasons where none can. An unknown
  name in the marker is a collection error naming the nearest known backend.
- ``ap_backend``: a fixture parametrised over the backends available here (or
  over the marker's list, or the session's backend); it yields the selected
  :class:`~accelport.contract.Backend` and restores accelport's state afterwards.

Before the first test, the plugin starts the device of every lazy (torch_xla) backend a
selected test runs on: torch's autograd engine sizes its device queues at the process's
first backward pass, and a torch_xla device started after a CPU backward fails its own.

``pytest -p no:accelport`` turns the plugin off entirely.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from accelport.errors import AccelportError, UnknownBackendError, did_you_mean
from accelport.runtime.state import RUNTIME

if TYPE_CHECKING:
    from accelport.contract import Backend
    from accelport.plugins.host import PluginHost

__all__ = ["Need", "ap_backend"]

OPTION = "--accelport-backend"
MARKER = "accelport"
FIXTURE = "ap_backend"
_MARKER_KEYWORDS = ("backends", "min_devices")


@dataclass(frozen=True)
class Need:
    """What a test's ``accelport`` marker asks for: one of ``backends``, with ``min_devices`` devices."""

    backends: tuple[str, ...]
    min_devices: int = 1


class _State:
    """Per-session state (in ``config.stash``): the session's backend and a plugin host for probing.

    The host is the plugin's own, built on first need, so asking what can run
    here never touches the runtime the tests themselves use.
    """

    def __init__(self) -> None:
        self.session_backend: str | None = None
        self._host: PluginHost | None = None

    @property
    def host(self) -> PluginHost:
        if self._host is None:
            from accelport.plugins.host import create_manager

            self._host = create_manager()
        return self._host

    def need(self, marker: pytest.Mark, nodeid: str) -> Need:
        """Read and check the marker of test ``nodeid``; raise ``AccelportError`` saying what is wrong."""
        where = f"the {MARKER} marker of {nodeid}"
        if marker.args:
            raise AccelportError(f"{where}: name the backends as backends=[...], not as positional "
                                 f"arguments (got {marker.args!r})")
        for key in marker.kwargs:
            if key not in _MARKER_KEYWORDS:
                hint = did_you_mean(key, _MARKER_KEYWORDS)
                raise AccelportError(f"{where}: unknown argument {key!r}.{hint} "
                                     f"The marker takes {', '.join(_MARKER_KEYWORDS)}.")
        raw = marker.kwargs.get("backends")
        if isinstance(raw, str):
            raw = [raw]
        if not (isinstance(raw, Sequence) and raw and all(isinstance(n, str) for n in raw)):
            raise AccelportError(f"{where}: backends must be a non-empty list of backend names, "
                                 f"e.g. backends=['xla', 'tpu'] (got {raw!r})")
        from accelport.runtime.selection import quoted

        known = self.host.backends
        names = []
        for name in raw:
            key = name.strip().lower()
            if key not in known:
                raise UnknownBackendError(quoted(name, os.environ), known, where)
            if key not in names:
                names.append(key)
        min_devices = marker.kwargs.get("min_devices", 1)
        if isinstance(min_devices, bool) or not isinstance(min_devices, int) or min_devices < 1:
            raise AccelportError(f"{where}: min_devices must be a positive integer (got {min_devices!r})")
        return Need(tuple(names), min_devices)

    def why_not(self, name: str, min_devices: int) -> str | None:
        """None when ``name`` can run this session's tests here, else the reason it cannot."""
        if self.session_backend and name != self.session_backend:
            return f"this session runs on {self.session_backend} ({OPTION} {self.session_backend})"
        probe = self.host.backends[name].probe()
        if not probe.available:
            return probe.reason
        if min_devices > 1 and (probe.device_count or 0) < min_devices:
            have = probe.device_count if probe.device_count is not None else "an unknown number of"
            return f"{have} device(s) here, the test needs {min_devices}"
        return None

    def verdicts(self, need: Need | None) -> list[tuple[str, str | None]]:
        """(backend, reason it cannot run or None) for every backend a test could run on.

        With a marker, each listed backend; without one, the session's backend, or
        else every registered backend that can run here (all of them, each with its
        reason, when none can: the test is then skipped, not lost).
        """
        if need is not None:
            return [(name, self.why_not(name, need.min_devices)) for name in need.backends]
        names = [self.session_backend] if self.session_backend else list(self.host.backends)
        found: list[tuple[str, str | None]] = [(name, self.why_not(name, 1)) for name in names]
        runnable: list[tuple[str, str | None]] = [(name, reason) for name, reason in found if reason is None]
        return runnable or found


_STATE = pytest.StashKey[_State]()
_CHOICE = pytest.StashKey[str]()  # the backend a marked test runs on
_TEST_SCOPE = pytest.StashKey[contextlib.ExitStack]()


def _state(config: pytest.Config) -> _State:
    if _STATE not in config.stash:
        config.stash[_STATE] = _State()
    return config.stash[_STATE]


def _need_or_fail(state: _State, marker: pytest.Mark | None, nodeid: str) -> Need | None:
    if marker is None:
        return None
    try:
        return state.need(marker, nodeid)
    except AccelportError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside the except: one message, no chained traceback


def _skip_reason(verdicts: list[tuple[str, str | None]]) -> str:
    return "; ".join(f"{name}: {reason}" for name, reason in verdicts if reason is not None)


# -- hooks ------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("accelport", "accelport backends")
    group.addoption(
        OPTION, dest="accelport_backend", metavar="NAME", default=None,
        help="run the session on this accelport backend (sets ACCELPORT_BACKEND; "
             "`accelport backends` lists the names); an unavailable backend is an error",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(backends, min_devices=1): run on the first listed accelport backend that is "
        "available here with at least min_devices devices; skip with the probe's reason otherwise",
    )
    name = config.getoption("accelport_backend")
    if name is None:
        return
    from accelport.runtime.selection import named

    state = _State()
    try:
        backend, _ = named(state.host.backends, name, OPTION, os.environ)  # (a long name: cut and redacted)
    except AccelportError as exc:
        raise pytest.UsageError(str(exc)) from None
    state.session_backend = backend.name
    config.stash[_STATE] = state
    previous = os.environ.get("ACCELPORT_BACKEND")
    os.environ["ACCELPORT_BACKEND"] = backend.name

    def restore() -> None:
        if previous is None:
            os.environ.pop("ACCELPORT_BACKEND", None)
        else:
            os.environ["ACCELPORT_BACKEND"] = previous

    config.add_cleanup(restore)


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash.get(_STATE, None)
    if state is None or state.session_backend is None:
        return None
    reason = state.host.backends[state.session_backend].probe().reason
    return f"accelport: {state.session_backend} ({OPTION}): {reason}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    uses_fixture = FIXTURE in metafunc.fixturenames
    if marker is None and not uses_fixture:
        return
    state = _state(metafunc.config)
    # A bad marker fails collection, so a typo can never pass as a skip.
    need = _need_or_fail(state, marker, metafunc.definition.nodeid)
    if not uses_fixture:
        return
    params = [
        pytest.param(name, id=name,
                     marks=() if reason is None else pytest.mark.skip(reason=_skip_reason([(name, reason)])))
        for name, reason in state.verdicts(need)
    ]
    metafunc.parametrize(FIXTURE, params, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Marked tests without the fixture: skip (at the test's own location) or note the backend.
    for item in items:
        marker = item.get_closest_marker(MARKER)
        if marker is None or FIXTURE in getattr(item, "fixturenames", ()):
            continue  # unmarked, or the fixture chooses (its parameters already honour the marker)
        state = _state(config)
        try:  # test functions were checked while collected; this catches other kinds of item
            verdicts = state.verdicts(state.need(marker, item.nodeid))
        except AccelportError as exc:
            raise pytest.UsageError(str(exc)) from None
        runnable = [name for name, reason in verdicts if reason is None]
        if runnable:
            item.stash[_CHOICE] = runnable[0]
        else:
            item.add_marker(pytest.mark.skip(reason=_skip_reason(verdicts)))


def _backend_of(item: pytest.Item) -> str | None:
    """The backend ``item`` runs on through the plugin (its marker's choice or its ``ap_backend``), if any."""
    name = item.stash.get(_CHOICE, None)
    if name is None:
        name = getattr(getattr(item, "callspec", None), "params", {}).get(FIXTURE)
    return name if isinstance(name, str) else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Start the device of every lazy (torch_xla) backend a selected test runs on, before the first test.

    torch's autograd engine sizes its per-device queues once, at the process's first backward
    pass, from the devices started by then: a torch_xla device started after a backward on the
    CPU fails every backward of its own (``INTERNAL ASSERT FAILED ... device_ready_queues_``).
    Started here, the ``[cpu]`` and ``[xla]`` cases of one test share the process in any order.
    """
    config = session.config
    state = config.stash.get(_STATE, None)
    if state is None or config.option.collectonly or (session.testsfailed and
                                                       not config.option.continue_on_collection_errors):
        return  # no test uses the plugin, or none runs
    names = {state.session_backend} if state.session_backend else set()
    names.update(name for name in map(_backend_of, session.items) if name is not None)
    for name in sorted(names):
        backend = state.host.backends.get(name)
        if backend is None or not backend.lazy or state.why_not(name, 1) is not None:
            continue  # (eager devices are torch's own or registered as their module loads)
        try:
            backend.device()
        except Exception:  # noqa: BLE001 - the tests on it fail with the error itself, where it belongs
            continue


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    name = item.stash.get(_CHOICE, None)
    if name is None:
        return
    # Selected before the test's fixtures are set up, so they see the same backend.
    stack = contextlib.ExitStack()
    stack.enter_context(RUNTIME.scoped())
    item.stash[_TEST_SCOPE] = stack
    RUNTIME.use(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        stack = item.stash.get(_TEST_SCOPE, None)
        if stack is not None:
            del item.stash[_TEST_SCOPE]
            stack.close()


@pytest.fixture
def ap_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The accelport backend this test runs on: one test per backend available here.

    Restricted to the ``accelport`` marker's backends when the test has one, and
    to the session's backend with ``--accelport-backend``. The backend is
    selected for the test (``ap.device()`` answers with it) and accelport's
    previous selection and counters come back after the test.
    """
    name: Any = getattr(request, "param", None)
    if name is None:
        pytest.fail(f"{FIXTURE} is parametrised when tests are collected: request it as an argument of "
                    "the test or of a function-scoped fixture the test uses, not with "
                    "request.getfixturevalue()", pytrace=False)
    with RUNTIME.scoped():
        yield RUNTIME.use(name)
