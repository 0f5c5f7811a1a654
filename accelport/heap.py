"""Live objects of a class, found in the garbage collector's heap without holding the heap."""

from __future__ import annotations

import gc
import warnings
from itertools import chain, starmap
from typing import Any

__all__ = ["live_instances"]


def live_instances(cls: type) -> list[Any]:
    """Every object the garbage collector tracks that is an instance of ``cls`` (a plain class, not an ABC).

    ``gc.get_objects()`` hands out every tracked object, tuples that another thread is still growing from a
    generator included: ``tuple()`` resizes those in place and raises SystemError in that thread if anything
    else holds one meanwhile (a DataLoader's pin-memory thread rebuilding a namedtuple batch, a prefetch
    thread). Holding the heap's list while Python code runs (a loop over it, a method called on each module)
    lets such a thread run. So the list is made, filtered and let go inside one call of C functions: nothing
    starts before ``list()`` pulls on it, ``type.__instancecheck__`` of a plain class is C, and no iterator
    that buffers is used (one made before the heap was read is in it: a cycle that would keep the heap's
    objects alive until the next collection). Only an object's own ``__class__`` property runs Python code.
    """
    if type(cls).__instancecheck__ is not type.__instancecheck__:  # (an ABC's check is Python code)
        raise TypeError(f"live_instances() needs a class whose metaclass is type, not {type(cls).__name__}")
    with warnings.catch_warnings():  # (reading the __class__ of a deprecated proxy in the heap warns)
        warnings.simplefilter("ignore")
        try:
            return list(filter(cls.__instancecheck__, chain.from_iterable(starmap(gc.get_objects, ((),)))))
        except Exception:  # noqa: BLE001 - an object whose __class__ property raises: told by its type alone
            return [o for o in gc.get_objects() if issubclass(type(o), cls)]
