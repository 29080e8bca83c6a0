"""A model's RoPE parameters, without torch (a storage node validates them at registration).

:mod:`kvmesh.kernels.rope` rotates keys with them (docs/kernels.md, "Re-RoPE").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RopeStyle(enum.Enum):
    """How a head's dimensions are paired for rotation."""

    #: Llama / HF ``rotate_half``: dimension ``i`` pairs with ``i + rotary_dim / 2``.
    NEOX = "neox"
    #: GPT-J: dimension ``2i`` pairs with ``2i + 1``.
    GPTJ = "gptj"


@dataclass(frozen=True, slots=True)
class RopeParams:
    """The RoPE parameters of a model, as an engine registers them with its KV.

    ``rotary_dim`` is the number of leading dimensions of each head that rotate
    (``head_dim`` for Llama; less for partial-rotary models); the rest pass through.
    """

    head_dim: int
    base: float = 10000.0
    rotary_dim: int | None = None
    style: RopeStyle = RopeStyle.NEOX

    def __post_init__(self) -> None:
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if not self.base > 0:
            raise ValueError(f"base must be positive, got {self.base}")
        rd = self.rotary
        if rd <= 0 or rd > self.head_dim or rd % 2:
            raise ValueError(
                f"rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {rd}"
            )

    @property
    def rotary(self) -> int:
        """The rotating dimensions (``rotary_dim``, or the whole head)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[rotary / 2]`` fp64 angular frequencies ``base ** (-2i / rotary)``.

        fp64: at position 4 000 an fp32 frequency is off by up to 2e-4 rad,
        which is the whole error budget of an fp32 key.
        """
        import torch

        exponents = torch.arange(0, self.rotary, 2, dtype=torch.float64, device=device)
        return 1.0 / (self.base ** (exponents / self.rotary))
