"""accelport.tensors.tree_map: nested containers rebuilt in their own class around the values it maps."""

from __future__ import annotations

import collections

import torch

from accelport.tensors import tree_map, tree_map_tensors


def test_each_container_keeps_its_class_and_a_defaultdict_its_factory() -> None:
    Point = collections.namedtuple("Point", "x y")
    nested = {"d": collections.defaultdict(list, a=torch.ones(1)), "o": collections.OrderedDict(b=torch.ones(2)),
              "p": Point(torch.ones(1), 3), "t": (torch.ones(1), [torch.ones(1), "s"])}
    out = tree_map_tensors(nested, lambda t: t * 2)
    assert type(out["d"]) is collections.defaultdict and out["d"].default_factory is list
    assert out["d"]["a"].tolist() == [2.0] and out["d"]["missing"] == []
    assert type(out["o"]) is collections.OrderedDict and out["o"]["b"].tolist() == [2.0, 2.0]
    assert type(out["p"]) is Point and out["p"].x.tolist() == [2.0] and out["p"].y == 3
    assert out["t"][0].tolist() == [2.0] and out["t"][1][0].tolist() == [2.0] and out["t"][1][1] == "s"


def test_a_leaf_may_be_a_container_itself() -> None:
    tagged = {"keep": {"tag": 1, "v": 2}, "list": [{"tag": 1, "v": 3}, {"v": 4}]}
    out = tree_map(tagged, lambda d: d["v"] * 10, lambda x: isinstance(x, dict) and "tag" in x)
    assert out == {"keep": 20, "list": [30, {"v": 4}]}


def test_a_heap_walk_while_a_tuple_is_mapped_does_not_break_it() -> None:
    # gc.get_objects() holds every object, a tuple being built among them: the step checks walk the heap that
    # way (to name a parameter) while a prefetch thread maps a batch. Here the walk runs inside the map itself,
    # so the tuple being built is held when it grows past its first allocation.
    import gc

    held = []

    def walk_the_heap(x: int) -> int:
        held.append(gc.get_objects())
        return x * 2

    class Pair(list):  # type: ignore[type-arg]
        pass

    out = tree_map((tuple(range(25)), Pair(range(3))), walk_the_heap, lambda x: isinstance(x, int))
    held.clear()
    assert out == (tuple(range(0, 50, 2)), [0, 2, 4]) and type(out[1]) is Pair
