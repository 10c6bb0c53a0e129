"""The one test-only way to change the LSE toolkit's measured constants (`softmax/config.py`,
`log_bmm.py`): a frozen config and its override."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Generic, TypeVar

C = TypeVar("C")


class ActiveConfig(Generic[C]):
    """A frozen config of measured constants and the one test-only way to change it: `override(**fields)`,
    a context manager (tests and benchmark sweeps; process-wide, not per thread)."""

    def __init__(self, default: C):
        self.default = default
        self._active = default

    def get(self) -> C:
        """The config launches use now: the default, or the innermost override's."""
        return self._active

    @contextlib.contextmanager
    def override(self, **changes) -> Iterator[C]:
        """Within the block, the active config's fields replaced by `changes` (unknown names raise
        TypeError)."""
        previous = self._active
        self._active = dataclasses.replace(previous, **changes)
        try:
            yield self._active
        finally:
            self._active = previous
