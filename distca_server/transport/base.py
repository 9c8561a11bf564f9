"""The interface every transport implements."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class Transport(Protocol):
    """One participant's endpoint of an all-to-all group.

    Attributes:
        rank: this participant's index in the group.
        world_size: number of participants.
        bytes_sent: running total of bytes this endpoint sent to *other* participants (its own
            split is a local copy and not counted).
    """

    rank: int
    world_size: int
    bytes_sent: int

    def all_to_all(self, send: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> torch.Tensor:
        """Ragged all-to-all of bytes; collective: every participant calls it once per exchange.

        Args:
            send: uint8 [sum(send_splits)]: the messages for participants 0..world_size-1, in order.
            send_splits: bytes for each participant (``world_size`` ints >= 0).
            recv_splits: bytes expected from each participant (``world_size`` ints >= 0).

        Returns:
            uint8 [sum(recv_splits)]: the messages from participants 0..world_size-1, in order.

        Raises:
            ValueError: splits of the wrong length or sum, or a peer sent a different size than
                ``recv_splits`` says.
            DistCAError: a peer did not join within the transport's timeout.
        """
        ...
