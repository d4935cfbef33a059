"""``CheckpointParticipant``: a module that takes part in every rank's ``he.save`` / ``he.load``.

A parameter-server trainer's collection holds no rows: before a collective save or load it
asks its servers to join (they write and read the tables' shards), and after a load it forgets
what it had pulled. It subclasses :class:`CheckpointParticipant` (found by ``isinstance``)."""

from __future__ import annotations

__all__ = ["CheckpointParticipant"]


class CheckpointParticipant:
    """A module's part in a collective save or load (see the module docstring)."""

    def before_checkpoint(self, action: str, path: str, options: dict) -> None:
        """Before every rank saves (``action="save"``) or loads ``path``: ``options`` are the call's
        (``keep``, ``incremental``, ``background``, ``verify``, ``optimizer``: whether one is given)."""

    def after_load(self) -> None:
        """After a load, on every rank, whether it succeeded or not."""
