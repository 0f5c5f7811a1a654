"""Live objects of a class, found in the garbage collector's heap without holding the heap."""

from __future__ import annotations

import gc
from functools import partial
from itertools import chain, compress, repeat, starmap
from typing import Any

__all__ = ["live_instances"]


def live_instances(cls: type) -> list[Any]:
    """Every object the garbage collector tracks whose own type is ``cls`` or a subclass of it (``cls``: a class
    of the caller's objects; not one that the search's own list or iterators are instances of, such as ``list``).

    ``gc.get_objects()`` hands out every tracked object, tuples that another thread is still growing from a
    generator included: ``tuple()`` resizes those in place and raises SystemError in that thread if anything
    else holds one meanwhile (a DataLoader's pin-memory thread rebuilding a namedtuple batch, a prefetch
    thread). Holding the heap's list while any Python code runs (a loop over it, a method of each module, an
    object's ``__class__`` property) lets such a thread run. So the list is made, filtered and let go inside
    the one ``list()`` call below, which runs C functions only:

    - nothing starts before ``list()`` pulls on it: ``gc.get_objects()`` runs inside it (``starmap``);
    - the list is handed out twice (``repeat``), once for the objects and once for their types, so no
      iterator buffers objects: one made before the heap was read is in it, and buffering would make a cycle
      that keeps the heap's objects alive until the next collection;
    - each object is judged by its own type (``type.__subclasscheck__``: neither ``__class__`` nor a
      metaclass's hooks are read, so a proxy that claims to be a ``cls`` is not one);
    - no collection runs meanwhile (on Python 3.11 one can start at any allocation, and run ``gc.callbacks``).
    """
    if not isinstance(cls, type) or type.__subclasscheck__(cls, list):
        raise TypeError(f"live_instances() needs a class of the caller's objects, not {cls!r}")
    collecting = gc.isenabled()
    gc.disable()
    try:
        heaps = chain.from_iterable(map(repeat, starmap(gc.get_objects, ((),)), (2,)))  # the one list, twice
        flags = partial(map, partial(type.__subclasscheck__, cls))
        return list(chain.from_iterable(map(compress, heaps, map(flags, map(partial(map, type), heaps)))))
    except BaseException:  # (out of memory: the iterators above, in the heap's list, hold it in a cycle)
        heaps = flags = None  # type: ignore[assignment]
        gc.collect()
        raise
    finally:
        if collecting:
            gc.enable()
