"""Background saves: the handle of a save written by a thread, and the writers of the dense state and the optimizer's file."""

from __future__ import annotations

import threading
import weakref

from torch import nn

from .snapshot import _Snapshot

# --- background saves -------------------------------------------------------------------------------
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its save in progress


class SaveHandle:
    """A save writing in the background (``he.save(..., background=True)``).

    ``wait()`` blocks until the version is committed and returns its directory, or raises the
    save's :class:`~hybridembed.CheckpointError` (then the previous version is still the
    current one, and the rows this save would have written are counted as changed again).
    ``done()`` says whether the writing finished. The next ``he.save`` or ``he.load`` of the
    same model waits for it first."""

    def __init__(self, model: nn.Module, snap: _Snapshot, run, wrap_error) -> None:
        self._snap, self._run, self._wrap = snap, run, wrap_error
        self._result: str | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._model = weakref.ref(model)
        _PENDING[model] = self
        self._thread = threading.Thread(target=self._work, name="hybridembed-save", daemon=False)
        self._thread.start()

    def _work(self) -> None:
        try:
            self._result = self._run()
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """The committed version's directory (blocks up to ``timeout`` seconds; None: until done)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save is still writing after {timeout} s")
        if not self._finished:
            self._finished = True
            model = self._model()
            if model is not None and _PENDING.get(model) is self:
                del _PENDING[model]
            self._snap.finish(self._error is None)
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):
                raise self._wrap(e) from e
            raise e
        return self._result

    result = wait

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error else f"committed {self._result}")
        return f"SaveHandle({state})"


def wait_pending(model: nn.Module) -> None:
    """Wait for ``model``'s background save, if any (its error, if it failed, is raised here)."""
    pending = _PENDING.get(model)
    if pending is not None:
        pending.wait()
