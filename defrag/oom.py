"""`OutOfMemoryError`: what a user sees when a pool cannot satisfy a request.

It subclasses `torch.OutOfMemoryError`, so existing `except
torch.OutOfMemoryError` handlers keep working; the torch-free layers raise
`defrag.core.OutOfRoom`, which the torch faces turn into this.
"""

from __future__ import annotations

import torch


class OutOfMemoryError(torch.OutOfMemoryError):
    """A pool could not satisfy an allocation request.

    The message names the request, the capacity, what is live, what is stranded
    in half-used pages, what is pinned, and what was already tried. The same
    figures are available as attributes (`requested`, `capacity`, `live`,
    `stranded`, `pinned`, `tried`).
    """

    def __init__(self, message: str, **figures):
        super().__init__(message)
        self.requested = figures.get("requested")
        self.capacity = figures.get("capacity")
        self.live = figures.get("live")
        self.stranded = figures.get("stranded")
        self.pinned = figures.get("pinned")
        self.tried = tuple(figures.get("tried", ()))
