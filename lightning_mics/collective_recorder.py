"""Counting collectives: what crossed which group, with how many bytes -- observation, apart from the runtime.

:class:`CollectiveRecorder` records every all-gather, reduce-scatter, all-reduce and broadcast this process
issues while it is active -- by FSDP2, Lightning, torchft or anyone else -- with the ranks of the group and the
bytes of the payload, through a dispatch mode (nothing in torch is patched). Tests use it to prove the 2-hop
schedule (which collective runs on which group in which micro-step); telemetry uses it to report bytes per
step. A collective built from other communication (the gloo ring's point-to-point messages, the compressed
hop's all-to-all) is recorded as the one collective it stands for (:func:`recorded_as_one`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_mics._compat import TorchDispatchMode, dispatch_mode_stack, op_schema_arguments, unbox_process_group


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as seen by this rank."""

    kind: str  #: "all_gather", "reduce_scatter", "all_reduce" or "broadcast"
    ranks: tuple[int, ...]  #: global ranks of the group it ran on (``()``: a group outside this world)
    bytes: int  #: payload bytes: the full (gathered / pre-scatter / reduced) buffer on this rank
    step: int  #: the value of :attr:`CollectiveRecorder.step` when it was issued


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group``; ``()`` for a group that is not part of this world -- torchft's
    reconfigurable groups across replica groups (fault tolerance), each rank's peers in other jobs."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except KeyError:
        return ()


def _nbytes(value: Any) -> int:
    """Bytes of a tensor, or of all tensors in a (nested) list of them; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class _C10dOp:
    """How to read one c10d dispatcher op: its kind, which arguments hold its tensors and its group,
    and whether it is a coalesced op (one collective per position of its tensor lists)."""

    kind: str
    tensor_args: tuple[int, ...]
    group_arg: int
    coalesced: bool


def _c10d_ops() -> dict[Any, _C10dOp]:
    """The c10d dispatcher ops every ``torch.distributed`` collective of a tracked kind ends in, on any
    backend: ``all_gather_single`` / ``all_gather_into_tensor`` -> ``_allgather_base_``, the list forms
    -> ``allgather_`` / ``reduce_scatter_``, ``all_reduce`` -> ``allreduce_``, ``broadcast`` (and the
    object collectives built on these) -> ``broadcast_`` / ``allgather_``; inside a coalescing
    manager gloo issues the ``*_coalesced_`` forms. Point-to-point (``send`` / ``recv_``), barriers,
    ``reduce`` / ``gather`` / ``scatter`` / all-to-all are not tracked kinds. Ops a torch version
    lacks are skipped. Argument positions come from each op's schema."""
    kinds = {
        "_allgather_base_": ("all_gather", False),
        "allgather_": ("all_gather", False),
        "allgather_coalesced_": ("all_gather", True),
        "allgather_into_tensor_coalesced_": ("all_gather", True),
        "_reduce_scatter_base_": ("reduce_scatter", False),
        "reduce_scatter_": ("reduce_scatter", False),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", True),
        "allreduce_": ("all_reduce", False),
        "allreduce_coalesced_": ("all_reduce", True),
        "broadcast_": ("broadcast", False),
    }
    ops: dict[Any, _C10dOp] = {}
    for name, (kind, coalesced) in kinds.items():
        packet = getattr(torch.ops.c10d, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            names = [argument.name for argument in op_schema_arguments(op)]
            group_arg = names.index("process_group")
            # the tensor arguments are the ones before the group (outputs and inputs; allreduce's
            # optional sparse indices come after it and are not payload)
            ops[op] = _C10dOp(kind, tuple(range(group_arg)), group_arg, coalesced)
    return ops


class _RecordingMode(TorchDispatchMode):
    """The dispatch mode behind :class:`CollectiveRecorder`: sees each c10d collective op as the
    dispatcher runs it and appends a :class:`CollectiveCall` to its recorder.

    Why a dispatch mode: every ``torch.distributed`` collective, whatever its Python spelling
    (``all_gather_single`` or the older ``all_gather_into_tensor``, ``_all_gather_base``, the object
    collectives) and whoever calls it (FSDP2, Lightning, DCP), ends in one c10d dispatcher op, so
    nothing in torch has to be replaced to see it. The mode stack is thread-local, which is what
    the recorder needs: it sees what the thread that entered it issues, and autograd carries the
    stack (part of ``at::ThreadLocalState``) into the threads it runs backward on -- on CPU backward
    runs on the calling thread itself, on CUDA in a device thread that gets the caller's modes -- so
    the collectives FSDP2 issues from its backward hooks are seen either way. Threads the program
    starts itself are not seen: FSDP2 and Lightning issue no collectives from one, and the only one
    here that does, the background checkpoint writer, carries no training traffic.

    Composite collectives (:func:`ring_reduce_scatter`) record themselves as one call through
    :func:`_recorded_as_one`, which hides their parts from the mode on this thread meanwhile.
    """

    #: Higher-order operators (``torch.cond``, ``flex_attention`` in eager, ...) reach the mode as a
    #: whole; without this flag torch refuses to run them under it. They run unrecorded, as one op:
    #: a collective inside their body would not be seen (none of FSDP2's or Lightning's is).
    supports_higher_order_operators = True

    def __init__(self, recorder: CollectiveRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._ops = _c10d_ops()
        self._hidden = threading.local()  # .depth: inside this many composite collectives

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` compile while a recorder is active (with ``False``, Dynamo would
        silently run every compiled block eagerly); FSDP2's collectives run outside compiled graphs."""
        return True

    def record(self, kind: str, ranks: tuple[int, ...], nbytes: int) -> None:
        if getattr(self._hidden, "depth", 0) == 0:
            self.recorder.calls.append(CollectiveCall(kind, ranks, nbytes, self.recorder.step))

    @contextmanager
    def hiding(self) -> Iterator[None]:
        self._hidden.depth = getattr(self._hidden, "depth", 0) + 1
        try:
            yield
        finally:
            self._hidden.depth -= 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        op = self._ops.get(func)
        if op is not None:
            self._record_op(func, op, args, kwargs)
        return func(*args, **kwargs)

    def _record_op(self, func: Any, op: _C10dOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        schema = op_schema_arguments(func)

        def argument(index: int) -> Any:
            return args[index] if index < len(args) else kwargs.get(schema[index].name)

        ranks = group_ranks(unbox_process_group(argument(op.group_arg)))
        tensors = [argument(i) for i in op.tensor_args]
        if op.coalesced:  # one collective per position: (output i, input i)
            for per_position in zip(*tensors):
                self.record(op.kind, ranks, max(_nbytes(t) for t in per_position))
        else:  # the gathered output, the pre-scatter input, or the reduced buffer
            self.record(op.kind, ranks, max(_nbytes(t) for t in tensors))


class CollectiveRecorder:
    """Context manager that records the collectives this process issues.

    Example::

        with CollectiveRecorder() as rec:
            loss.backward()
        rec.count("all_reduce")  # how many all-reduces this backward issued

    Nothing in torch is replaced while it records: it pushes a dispatch mode (see
    :class:`_RecordingMode`) onto the thread's mode stack and pops it on exit. Recorders (and other
    dispatch modes) must therefore be exited in the reverse order they were entered. What it sees
    is what the entering thread issues, backward passes included; work on threads of the program's
    own -- e.g. the background checkpoint writer's collectives, in a group of their own -- is not
    training traffic and is not recorded.
    """

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        #: Free-form step label stamped on each call (tests set it per micro-step).
        self.step: int = 0
        self._mode: Optional[_RecordingMode] = None

    def __enter__(self) -> CollectiveRecorder:
        if self._mode is not None:
            raise RuntimeError("this CollectiveRecorder is already recording")
        self._mode = _RecordingMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is None:
            return
        stack = dispatch_mode_stack()
        if not stack or stack[-1] is not self._mode:
            # Popping would remove the other mode instead; refused, and this recorder stays active
            # so that exiting the other one first and then this one still works.
            raise RuntimeError(
                "CollectiveRecorder exited while a dispatch mode entered after it is still active; "
                "exit recorders in the reverse order of entering them"
            )
        self._mode.__exit__(None, None, None)
        self._mode = None

    # ------------------------------------------------------------------ queries
    def count(self, kind: str, step: int | None = None) -> int:
        return sum(1 for c in self.calls if c.kind == kind and (step is None or c.step == step))

    def bytes_by_kind(self, step: int | None = None) -> Counter[str]:
        totals: Counter[str] = Counter()
        for call in self.calls:
            if step is None or call.step == step:
                totals[call.kind] += call.bytes
        return totals

    def reset(self) -> None:
        self.calls.clear()


@contextmanager
def recorded_as_one(kind: str, group: Any, payload: torch.Tensor | int) -> Iterator[None]:
    """Record a collective built from other communication (the ring's point-to-point messages) as
    one call of ``kind`` with ``payload``'s bytes (a tensor's, or a number of bytes), in every
    recorder active on this thread, and hide the communication inside the block from them. Scoped
    explicitly: it finds the recorders on the thread's dispatch-mode stack -- the very ones that
    would see a c10d op issued here -- and keeps no state once the block ends."""
    modes = [mode for mode in dispatch_mode_stack() if isinstance(mode, _RecordingMode)]
    if not modes:
        yield
        return
    ranks, nbytes = group_ranks(group), payload if isinstance(payload, int) else _nbytes(payload)
    with ExitStack() as stack:
        for mode in modes:
            mode.record(kind, ranks, nbytes)
            stack.enter_context(mode.hiding())
        yield
