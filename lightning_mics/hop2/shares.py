"""Each data share's gradient accumulated on its own and summed across shares in fp64: what makes a run with a
lost group bit-identical to the run without (``FaultTolerance(exact_trajectory=True)``).

Why: with a group lost, a survivor reads its own share of each micro-step and the lost group's. Summed into one
gradient -- one larger micro-batch, or one accumulator -- the same numbers are added in another order than the
failure-free run adds them, fp32 rounds differently in the last bit, and training (Adam most of all) amplifies
that step by step into another loss curve. Kept apart, every share's gradient is exactly the one its own group
would have computed: the same samples, micro-batch shape, parameters and kernels (one forward and backward per
share), accumulated over the micro-steps in the same order (its own accumulator), reduce-scattered inside the
partition the same way. What is left is the sum across shares, which the failure-free run does in hop 2 over
groups and the survivor partly at home: done in fp64 -- each share's fp32 gradient widened, summed, divided by
the number of shares and rounded to fp32 once -- it no longer depends on which group added which share, since
a sum of a few fp32 numbers is exact in fp64 unless their exponents lie more than ~28 binary orders apart (and
even then the fp32 result differs only if the fp64 sum falls on a rounding boundary of fp32).

The price: hop 2 crosses in fp64 (twice fp32's bytes), and a survivor keeps one more gradient shard per extra
share it reads while a group is out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mics.grad_sync import fsdp_units, local_shard

#: The dtype shares are summed in across groups.
EXACT_SUM_DTYPE = torch.float64


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

    def pack(self, params: Sequence[Tensor], padded_numel: Sequence[int]) -> Tensor:
        """``params``' gradient shards, every share's summed in fp64, in one flat buffer at the padded offsets
        (zeros in the padding) -- :func:`~lightning_mics.hop2.pipeline.pack_gradient_shards` across shares."""
        index = {id(p): i for i, p in enumerate(self.params)}
        device = local_shard(params[0]).device
        flat = torch.zeros(sum(padded_numel), dtype=EXACT_SUM_DTYPE, device=device)
        offset = 0
        for param, numel in zip(params, padded_numel):
            grads = [param.grad] + [aside[index[id(param)]] for aside in self._aside.values()]
            for grad in grads:
                if grad is not None:
                    shard = local_shard(grad).reshape(-1)
                    flat[offset : offset + shard.numel()] += shard
            offset += numel
        return flat

    def clear(self) -> None:
        """The step's sum is taken (or the step dropped): forget the shares set aside."""
        self._aside.clear()
        self.current = None
