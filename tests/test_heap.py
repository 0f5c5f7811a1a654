"""Searching the live objects: only instances come back, by their own type; a tuple another thread is growing
survives it, and nothing is kept alive by it."""

from __future__ import annotations

import abc
import gc
import threading
import traceback
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from accelport.heap import live_instances
from accelport.observe.memory import MemoryWatch
from accelport.observe.numerics import param_names


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)


def test_live_instances_gives_the_instances_of_a_class_and_its_subclasses_only() -> None:
    class Base:
        pass

    class Child(Base):
        pass

    kept = [Base(), Child(), Base()]
    found = live_instances(Base)
    assert sorted(map(id, found)) == sorted(map(id, kept))
    assert [o for o in live_instances(Child)] == [kept[1]]


def test_an_object_is_judged_by_its_own_type_never_by_what_its_class_property_says() -> None:
    class Wanted:
        pass

    class Claims:
        """A proxy that says it is a Wanted (a mock with a spec), or cannot say anything (werkzeug's
        LocalProxy outside its context): reading its __class__ runs Python code, or raises."""

        def __init__(self, says: Any) -> None:
            self.says = says

        @property  # type: ignore[misc]
        def __class__(self) -> type:
            if self.says is None:
                raise RuntimeError("working outside of its context")
            return self.says

    class Abstract(abc.ABC):  # (a metaclass whose own check is Python code: not asked either)
        @abc.abstractmethod
        def run(self) -> None: ...

    class Concrete(Abstract):
        def run(self) -> None: ...

    held = (Claims(Wanted), Claims(None), Wanted(), Concrete())
    assert live_instances(Wanted) == [held[2]]
    assert live_instances(Abstract) == [held[3]]


@pytest.mark.parametrize("cls", [None, list, object])
def test_a_class_the_search_would_find_itself_in_or_no_class_is_refused(cls: Any) -> None:
    with pytest.raises(TypeError, match="needs a class of the caller's objects"):
        live_instances(cls)


def test_no_collection_runs_during_the_search() -> None:
    # (On Python 3.11 a collection can start at any allocation and run the gc.callbacks, Python code.)
    ran: list[str] = []

    def callback(phase: str, info: Any) -> None:
        if any(frame.name == "live_instances" for frame in traceback.extract_stack()):
            ran.append(phase)

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(callback)
    try:
        live_instances(_Net)
        during = list(ran)
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
    assert during == []


def test_the_search_keeps_nothing_alive() -> None:
    class Other:
        pass

    gone = Other()
    ref = weakref.ref(gone)
    gc.disable()  # (a cycle through the heap's list would keep it until a collection)
    try:
        live_instances(_Net)
        del gone
        assert ref() is None
    finally:
        gc.enable()


def _grown_beside(search: Callable[[], Any]) -> dict[str, Any]:
    """Run ``search`` while another thread is halfway through ``tuple(generator)``; the thread finishes while
    the search calls a module's method. What the thread got: its tuple, or the error it raised."""
    release, ready = threading.Event(), threading.Event()
    got: dict[str, Any] = {}

    def items() -> Any:
        yield 1
        ready.set()
        release.wait(120)
        yield 2

    def grow() -> None:
        try:
            got["tuple"] = tuple(items())  # (its guessed length is 10: cut back to 2 at the end, in place)
        except SystemError as exc:
            got["error"] = exc

    class Trigger(torch.nn.Module):
        """A module whose parameters are asked for during the search: the other thread goes on meanwhile."""

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
            release.set()
            thread.join(120)
            return super().named_parameters(*args, **kwargs)

        def parameters(self, recurse: bool = True) -> Any:
            return (p for _, p in self.named_parameters(recurse=recurse))

    class Claims:
        """An object whose __class__ property lets the other thread go on, were it read during the search."""

        @property  # type: ignore[misc]
        def __class__(self) -> type:
            release.set()
            thread.join(120)
            return Claims

    trigger, claims = Trigger(), Claims()
    thread = threading.Thread(target=grow)
    thread.start()
    assert ready.wait(120)
    search()
    release.set()
    thread.join(120)
    del trigger, claims
    return got


def test_the_search_itself_leaves_a_tuple_another_thread_grows_alone() -> None:
    found: list[Any] = []
    got = _grown_beside(lambda: found.extend(live_instances(_Net)))
    assert got == {"tuple": (1, 2)}
    assert found == []


def test_naming_parameters_leaves_a_tuple_another_thread_grows_alone() -> None:
    net = _Net()
    names: dict[int, str] = {}
    got = _grown_beside(lambda: names.update(param_names(list(net.parameters()))))
    assert got == {"tuple": (1, 2)}
    assert sorted(names.values()) == ["fc.bias", "fc.weight"]


def test_finding_the_model_for_its_memory_leaves_a_tuple_another_thread_grows_alone() -> None:
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = MemoryWatch(SimpleNamespace())  # (a backend that shards nothing: the model is searched for)
    watch.step_end(1, opt)
    found: list[Any] = []
    got = _grown_beside(lambda: found.append(watch.model()))
    assert got == {"tuple": (1, 2)}
    assert found == [net]
