"""Teardown that runs every step and hides no error."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from types import TracebackType

__all__ = ["Cleanup"]

#: What :meth:`Cleanup.run` may be told to expect: one exception type or several.
Expected = type[BaseException] | tuple[type[BaseException], ...]


class Cleanup:
    """Cleanup steps that all run, whatever fails, and whose errors all surface.

    ::

        with Cleanup() as cleanup:
            for engine in engines:
                cleanup.run(engine.close)
            cleanup.run(loop.close)

    :meth:`run` calls its step at once and records what the step raises
    instead of stopping, so the steps after it still run (nothing is left
    behind). Leaving the ``with`` block (or :meth:`raise_errors`) raises what
    was recorded: the first error (the first that is not an :class:`Exception`,
    such as ``KeyboardInterrupt``, if there is one), with each of the others
    and its traceback attached as a note (``__notes__``, which pytest prints).
    """

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def run(self, step: Callable[[], object], *, expect: Expected = ()) -> None:
        """Run ``step`` now; record what it raises.

        ``expect`` names the errors the step is known to end with (closing
        a connection to a process the test killed on purpose): those are
        dropped, anything else is recorded.
        """
        try:
            step()
        except expect:
            pass
        except BaseException as exc:  # every step runs; the error is raised at the end
            self.errors.append(exc)

    def raise_errors(self) -> None:
        """Raise what the steps so far raised (and forget it); nothing if they all went well."""
        errors, self.errors = self.errors, []
        if not errors:
            return
        first = next((error for error in errors if not isinstance(error, Exception)), errors[0])
        for other in errors:
            if other is not first:
                _add_note(first, "another cleanup step failed too:\n" + "".join(traceback.format_exception(other)))
        raise first

    def __enter__(self) -> Cleanup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.raise_errors()


def _add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, also before Python 3.11 (which only lacks the method)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        notes = getattr(error, "__notes__", None)
        if isinstance(notes, list):
            notes.append(note)
        else:
            error.__notes__ = [note]
