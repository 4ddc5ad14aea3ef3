"""Each data share's gradient accumulated on its own and summed across shares in one fixed order: what makes a
run with a lost group bit-identical to the run without (``FaultTolerance(exact_trajectory=True)``).

Why: with a group lost, a survivor reads its own share of each micro-step and the lost group's. Summed into one
gradient -- one larger micro-batch, or one accumulator -- the same numbers are added in another order than the
failure-free run adds them, fp32 rounds differently in the last bit, and training (Adam most of all) amplifies
that step by step into another loss curve. Kept apart, every share's gradient is exactly the one its own group
would have computed: the same samples, micro-batch shape, parameters and kernels (one forward and backward per
share), accumulated over the micro-steps in the same order (its own accumulator), reduce-scattered inside the
partition the same way. What is left is the sum across shares, which a ring all-reduce adds in an order that
depends on how many groups take part. Here every slice of the buffer is summed by one group in share order
(``share 0 + share 1 + ...``, in fp32), whoever read which share: an all-to-all sends each group's shares'
slices to the slice's owner, which sums them and divides by the number of shares, and an all-gather returns
the slices (:class:`~lightning_mics.hop2.transport.ManagedTransport`) -- the bytes of a ring all-reduce while
every group reads one share.

The price: a survivor keeps one more gradient shard per extra share it reads while a group is out, and sends
its shares' slices each (more bytes only then).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mics.shards import fsdp_units, local_shard


class ShareGradients:
    """The gradient accumulators of the data shares one group trains in a step, one at a time in the parameters'
    ``.grad`` (where FSDP2 accumulates the reduce-scattered micro-steps) and the others set aside."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        #: the model's FSDP units (whose boundary flag an extra share's pass turns off)
        self.units = fsdp_units(module)
        #: the share whose accumulator is in ``.grad`` (``None``: no share chosen since the last step)
        self.current: Optional[int] = None
        self._aside: dict[int, list[Optional[Tensor]]] = {}

    def use(self, share: int) -> None:
        """Put ``share``'s accumulator into the parameters' ``.grad`` (none yet: ``None``), setting the current
        one aside. The first share of a step takes whatever ``.grad`` holds (``None`` after ``zero_grad``)."""
        if share == self.current:
            return
        if self.current is not None:
            self._aside[self.current] = [p.grad for p in self.params]
            grads = self._aside.pop(share, None)
            for param, grad in zip(self.params, grads or [None] * len(self.params)):
                param.grad = grad
        self.current = share

    @property
    def others(self) -> int:
        """Shares set aside (0 with every group live)."""
        return len(self._aside)

    def pack(self, params: Sequence[Tensor], padded_numels: Sequence[int]) -> Tensor:
        """``params``' gradient shards of each share this group read in the step, one row per share in ascending
        share order (the order the shares are dealt to a group in), each at the padded offsets of
        :func:`~lightning_mics.hop2.pipeline.pack_gradient_shards` (zeros in the padding)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        first = local_shard(params[0])  # FSDP2 keeps a sharded gradient in its sharded parameter's dtype
        used = sorted([*([] if self.current is None else [self.current]), *self._aside]) or [None]  # None: .grad
        rows = torch.zeros(len(used), sum(padded_numels), dtype=first.dtype, device=first.device)
        for row, share in enumerate(used):
            offset = 0
            for param, numel in zip(params, padded_numels):
                grad = param.grad if share == self.current else self._aside[share][index[id(param)]]
                if grad is not None:
                    shard = local_shard(grad).reshape(-1)
                    rows[row, offset : offset + shard.numel()].copy_(shard)
                offset += numel
        return rows

    def clear(self) -> None:
        """The step's sum is taken (or the step dropped): forget the shares set aside."""
        self._aside.clear()
        self.current = None
