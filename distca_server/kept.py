"""The kept activations of a :class:`~distca_server.participant.Participant` (a plan with
``keep_activations``; the scheme is in :mod:`distca_server.participant`'s docstring): what a
forward round keeps under its key, what the backward round with that key takes back, and dropping
them. A mixin: it works on the participant's ``kept``, ``kept_merged``, ``released``, roles,
``merged_rows``, ``split_pos`` / ``unsplit_pos`` and ``fmt``."""

from __future__ import annotations

import torch

from scheduler.cost import KEPT_TENSORS

MAX_KEPT_ROUNDS = 1024
"""Forward rounds (layers) whose activations one participant keeps at once; one more is refused
with a ValueError (a loop that never runs its backward rounds would otherwise grow without end)."""


class KeptActivations:
    """The kept-activation part of :class:`~distca_server.participant.Participant`."""

    # ---- kept activations --------------------------------------------------------------------------
    def _keeps_merged(self) -> bool:
        """Whether the client role keeps merged O and LSE rows (it owns a split shard)."""
        return self.rank is not None and len(self.merged_rows) > 0

    def _check_keep(self, keep: int | None) -> None:
        if keep is None or (self.server is None and not self._keeps_merged()):
            return
        if not self.keep_activations:
            raise ValueError(f"{self._who()}: forward round {keep} asks to keep activations, but the "
                             f"plan was made with keep_activations=False")
        if keep in self.kept or keep in self.kept_merged:
            raise ValueError(f"{self._who()}: already keeps the activations of forward round {keep}")
        if max(len(self.kept), len(self.kept_merged)) >= MAX_KEPT_ROUNDS:
            raise ValueError(f"{self._who()}: keeps the activations of {len(self.kept)} forward rounds "
                             f"already (at most {MAX_KEPT_ROUNDS}); run their backward rounds or start "
                             f"a new step")

    def _keep(self, keep: int, inputs: dict, results: dict, shared: bool) -> None:
        """Keep this forward round's rows: ``inputs`` are views of the reused receive buffer
        (copied) or, when ``shared``, the client's own tensors (referenced, like ``results``)."""
        rows = {n: (x if shared else x.clone()) for n, x in inputs.items()}
        if self.split_pos is not None:  # a split task's O and LSE are partial: keep the others only
            results = {n: x.index_select(0, self.unsplit_pos) for n, x in results.items()}
        rows.update(results)
        self.adopt(keep, {n: rows[n] for n in KEPT_TENSORS}, None)

    def adopt(self, keep: int, rows: dict | None, merged: dict | None) -> None:
        """Keep under ``keep``: the server role's ``rows`` ({name: tensor} of
        :data:`~scheduler.cost.KEPT_TENSORS`, None for no server role; their versions recorded,
        as autograd records a saved tensor's) and the client role's merged ``out`` and ``lse``
        rows (None when it owns no split shard). An eager forward round's (:meth:`_keep`), or a
        replayed or recorded one's (:mod:`~distca_server.runtime.graphed`). The caller checked
        ``keep`` (:meth:`_check_keep`)."""
        if rows is not None:
            self.kept[keep] = (rows, [(t, t._version) for t in rows.values()])
        if merged is not None:
            self.kept_merged[keep] = merged

    def _full(self, kept: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        """The server's O (or LSE) rows for the fused call: its own kept rows of unsplit tasks
        and the received merged rows of split tasks, each in its place."""
        if self.split_pos is None:
            return kept
        full = merged.new_empty((len(kept) + len(merged), *merged.shape[1:]))
        full.index_copy_(0, self.unsplit_pos, kept)
        return full.index_copy_(0, self.split_pos, merged)

    def _missing(self, kept: int) -> ValueError:
        why = f" (dropped: {self.released})" if self.released else ""
        return ValueError(f"{self._who()}: keeps no activations of forward round {kept}{why}")

    def _take_merged(self, kept: int, like: torch.Tensor) -> dict:
        """The client role's merged ``out`` and ``lse`` rows kept under ``kept`` (none when it
        owns no split shard), no longer held here; ``like`` gives the dtype and device."""
        if not self._keeps_merged():
            fmt = self.fmt
            return {"out": like.new_empty((0, fmt.num_heads_q, fmt.head_dim)),
                    "lse": like.new_empty((0, fmt.num_heads_q), dtype=fmt.lse_dtype)}
        found = self.kept_merged.pop(kept, None)
        if found is None:
            raise self._missing(kept)
        return found

    def _take_kept(self, kept: int) -> dict:
        """The rows kept under ``kept``, no longer held here (freed when the round ends)."""
        found = self.kept.pop(kept, None)
        if found is None:
            raise self._missing(kept)
        rows, versions = found
        if any(t._version != v for t, v in versions):
            raise RuntimeError(f"{self._who()}: a tensor needed for the backward round of forward round "
                               f"{kept} (q, k, v or out) was modified by an inplace operation")
        return rows

    def held_bytes(self) -> int:
        """Bytes of kept activations this participant holds now: its server role's rows
        (``Plan.held_bytes``) and its client role's merged rows of split shards
        (``Plan.owner_held_bytes``)."""
        rows = [t for rows, _ in self.kept.values() for t in rows.values()]
        rows += [t for kept in self.kept_merged.values() for t in kept.values()]
        return sum(t.numel() * t.element_size() for t in rows)

    def release(self, why: str = "released") -> None:
        """Drop every kept activation (the step ended or a round failed); a later backward round
        naming one raises a ValueError carrying ``why``."""
        if self.kept or self.kept_merged:
            self.released = why
        self.kept.clear()
        self.kept_merged.clear()

    def release_round(self, key: int) -> None:
        """Drop the activations kept under ``key`` alone, if any. Autograd freed that forward
        round's node without a backward round: a forward recomputed by activation checkpointing,
        or one never backpropagated. Nothing will name the key again."""
        self.kept.pop(key, None)
        self.kept_merged.pop(key, None)


__all__ = ["KeptActivations", "MAX_KEPT_ROUNDS"]
