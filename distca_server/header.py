"""The round header: a tiny all-to-all before each round so every participant knows, and checks,
which round comes next.

Dedicated servers learn the step, batch, round kind, dtype and softmax scale of the next round
from it (they have no batch of their own); every participant checks that all clients agree, so a
client that runs ahead or behind (or a different model) fails the round on everyone at once
instead of silently mixing rounds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from scheduler.cost import RoundKind

from .dtypes import DTYPE_CODES, DTYPES_BY_CODE
from .transport.base import all_to_all
_FIELDS = 6
HEADER_BYTES = 8 * _FIELDS


@dataclass(frozen=True)
class RoundHeader:
    """``(step, batch, seq, kind, dtype, softmax_scale)`` of one round; ``seq`` counts the rounds
    of the step on this client."""

    step: int
    batch: int
    seq: int
    kind: RoundKind
    dtype: torch.dtype
    softmax_scale: float

    def encode(self) -> torch.Tensor:
        scale_bits = struct.unpack("<q", struct.pack("<d", self.softmax_scale))[0]
        values = [self.step, self.batch, self.seq, self.kind.code, DTYPE_CODES[self.dtype], scale_bits]
        return torch.tensor(values, dtype=torch.int64).view(torch.uint8)

    @classmethod
    def decode(cls, raw: torch.Tensor) -> "RoundHeader":
        step, batch, seq, kind, dtype, bits = raw.view(torch.int64).tolist()
        if dtype not in DTYPES_BY_CODE:
            raise ValueError(f"malformed round header: dtype code {dtype}")
        try:
            round_kind = RoundKind.from_code(kind)
        except ValueError:
            raise ValueError(f"malformed round header: kind code {kind}") from None
        return cls(step, batch, seq, round_kind, DTYPES_BY_CODE[dtype],
                   struct.unpack("<d", struct.pack("<q", bits))[0])

    def describe(self) -> str:
        return (f"step {self.step} batch {self.batch} round {self.seq} ({self.kind.value}, "
                f"{str(self.dtype).removeprefix('torch.')})")


def exchange_header(transport, mine: RoundHeader | None, num_clients: int,
                    timeout_s: float | None = None) -> RoundHeader:
    """Send ``mine`` (None on a dedicated server) to everyone; return the clients' common header.

    Raises:
        ValueError: clients disagree on the next round (every participant raises the same).
        DistCAError: the exchange failed (from the transport).
    """
    P = transport.world_size
    payload = mine.encode() if mine is not None else torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    send = payload.repeat(P)
    recv = all_to_all(transport, send.to(transport.device), [HEADER_BYTES] * P, [HEADER_BYTES] * P,
                      timeout_s=timeout_s).cpu()
    raws = recv.view(P, HEADER_BYTES)[:num_clients]
    if not all(torch.equal(raws[0], r) for r in raws[1:]):
        seen = []
        for r, raw in enumerate(raws):
            try:
                seen.append(f"rank {r}: {RoundHeader.decode(raw.clone()).describe()}")
            except ValueError:
                seen.append(f"rank {r}: malformed")
        raise ValueError("clients disagree on the next round: " + "; ".join(seen))
    return RoundHeader.decode(raws[0].clone())
