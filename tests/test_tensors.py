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
