"""What both Lightning front ends expose alike: :class:`MiCSFrontEnd`, mixed into the Trainer's and Fabric's
``MiCSStrategy`` before Lightning's ``ParallelStrategy``.

The constructor (options by name or as a :class:`~lightning_mics.options.MiCSOptions`), the devices, the
layout, the options as attributes, the launcher check, the reductions and registration -- all read from or
handed to the one :class:`~lightning_mics.engine.MiCSEngine` the strategy holds, so that neither front end
repeats the other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_mics import _compat as compat
from lightning_mics.engine import MiCSEngine, MiCSLayout, MiCSTopology, WireFormat
from lightning_mics.options import (
    GradAccumulation,
    MiCSOptions,
    PartitionSizeSpec,
    ShardingOption,
    register_strategy_names,
)

#: Options that both strategies expose as attributes of the same name, read from (and set into) the engine's
#: options; the others are read through the layout's resolved values below, or ``strategy.options``.
OPTION_ATTRIBUTES = (
    "auto_wrap_policy",
    "hierarchical",
    "activation_checkpointing_policy",
    "prefetch_depth",
    "compile_blocks",
    "save_full_state_dict",
    "sync_module_states",
    "checkpoint_verify",
    "buffer_sync",
    "gc_freeze",
    "planner_cluster",
    "release_gradients_after_step",
    "cpu_offload",
)


class _Option:
    """A strategy attribute that is the option of the same name (setting it re-validates the options)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, strategy: Any, owner: Optional[type] = None) -> Any:
        if strategy is None:
            return self
        return getattr(strategy._engine.options, self.name)

    def __set__(self, strategy: Any, value: Any) -> None:
        engine = strategy._engine
        engine.options = replace(engine.options, **{self.name: value})


class MiCSFrontEnd:
    """Mixed into both Lightning strategies (before Lightning's ``ParallelStrategy``): the devices, the
    layout and the options, read from the one :class:`MiCSEngine` the strategy holds."""

    _engine: MiCSEngine
    _fsdp_units: list[FSDPModule]
    parallel_devices: Optional[list[torch.device]]
    local_rank: int

    # the options in OPTION_ATTRIBUTES are attributes too (set below the class)

    strategy_name = "mics"
    #: how the Lightning base class names its precision-plugin argument
    _precision_argument: str
    #: the framework's launcher for processes it starts itself
    _launcher_class: Any
    cluster_environment: Any
    _launcher: Any
    #: the Trainer (it tells the accumulation count, so ``grad_accumulation="auto"`` can be planned, and has
    #: a teardown that waits for background saves) or Fabric (neither: it refuses the Trainer-only options)
    _trainer_front_end: bool

    def __init__(
        self,
        options: Optional[MiCSOptions] = None,
        *,
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        precision: Any = None,
        **option_values: Any,
    ) -> None:
        """MiCS options by name or as a :class:`~lightning_mics.options.MiCSOptions` (keywords replace its
        values); LightningCLI follows ``option_values`` into ``MiCSOptions`` (jsonargparse). The Lightning
        arguments are set by the framework; the precision plugin under either name (the Trainer's strategies
        call it ``precision_plugin``, Fabric's ``precision``)."""
        precision = precision_plugin if precision is None else precision
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            **{self._precision_argument: precision},
        )
        MiCSOptions.check_names(options, option_values)
        given = MiCSOptions(**option_values) if options is None else replace(options, **option_values)
        if not self._trainer_front_end:
            given.refuse_trainer_only()
        self._engine = MiCSEngine(given, trainer_loop=self._trainer_front_end)
        self._num_nodes = 1
        self._fsdp_units: list[FSDPModule] = []  # of every model set up (per model: blocks, then its root)
        self._init_front_end_state()

    def _configure_launcher(self) -> None:
        """Lightning's launcher starts the local ranks when the cluster environment does not: refuse an
        invalid layout before it does, once (see :meth:`MiCSEngine.check_before_launch`)."""
        environment = self.cluster_environment
        assert environment is not None
        devices = self.parallel_devices
        device_type = devices[0].type if devices else None
        self._engine.check_devices_before_launch(device_type, self.num_processes, self.num_nodes)
        if not environment.creates_processes_externally:
            self._engine.check_before_launch(self.num_processes, self.num_nodes)
            self._launcher = self._launcher_class(environment, self.num_processes, self.num_nodes)

    def _init_front_end_state(self) -> None:
        """The front end's own state (models, units), created at construction."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_strategy_names(strategy_registry, cls, knows_accumulation=cls._trainer_front_end)

    @property
    def options(self) -> MiCSOptions:
        """The options as given (:class:`~lightning_mics.options.MiCSOptions`)."""
        return self._engine.options

    @property
    def engine(self) -> MiCSEngine:
        return self._engine

    @property
    def fsdp_units(self) -> list[FSDPModule]:
        """The FSDP2 units of every model set up so far (per model: blocks, then its root), after setup."""
        return list(self._fsdp_units)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._engine.backend

    @property
    def layout(self) -> MiCSLayout:
        return self._engine.layout()

    @property
    def topology(self) -> MiCSTopology:
        return self._engine.layout().settings.topology

    def outer_round(self) -> Optional[tuple[int, bool]]:
        """With ``cross_replica_sync="diloco"``: (optimizer steps between two outer averages, whether the next
        step starts one); ``None`` with a hop 2 every step."""
        return self._engine.outer_round()

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._engine.layout().device_mesh

    @property
    def cross_replica_wire(self) -> Optional[WireFormat]:
        return self._engine.cross_replica_wire

    @property
    def cross_replica_dtype(self) -> Union[torch.dtype, str, None]:
        """The resolved ``cross_replica_dtype``: ``torch.bfloat16`` / ``torch.float16``, ``"int8"``
        or ``None`` (:attr:`cross_replica_wire` is the format itself)."""
        wire = self.cross_replica_wire
        return None if wire is None else wire.option

    @property
    def async_save(self) -> bool:
        """Whether sharded checkpoints are written in the background."""
        return self._engine.async_saver is not None

    @property
    def checkpoint_stall_s(self) -> list[float]:
        return self._engine.checkpoint_stall_s

    # the layout's resolved values once it exists ("auto" settings, ShardingSpec degrees), else the options
    @property
    def ranks_per_node_override(self) -> Optional[int]:
        return self._engine.options.ranks_per_node

    @property
    def partition_size_spec(self) -> PartitionSizeSpec:
        o, layout = self._engine.options, self._engine.layout_or_none
        if layout is not None and (o.sharding is not None or "auto" in (o.partition_size, o.grad_accumulation)):
            return layout.settings.topology.partition_size
        return o.partition_size

    @property
    def sharding(self) -> ShardingOption:
        o, layout = self._engine.options, self._engine.layout_or_none
        return layout.settings.sharding if layout is not None and o.sharding == "auto" else o.sharding

    @property
    def reshard_after_forward(self) -> Union[bool, int]:
        layout = self._engine.layout_or_none
        return self._engine.options.reshard_after_forward if layout is None else layout.settings.reshard_after_forward

    @property
    def grad_accumulation_spec(self) -> str:
        return self._engine.options.grad_accumulation

    @property
    def grad_accumulation(self) -> Optional[GradAccumulation]:
        """The mode in use: the layout's once it exists, else the option (``None`` while it is ``"auto"``)."""
        layout, spec = self._engine.layout_or_none, self._engine.options.grad_accumulation
        if layout is not None:
            return layout.settings.grad_accumulation
        return None if spec == "auto" else spec  # type: ignore[return-value]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Lightning's reduction of logged values over the world (``all_reduce`` in Fabric)."""
        if isinstance(tensor, Tensor):
            return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    all_reduce = reduce

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._engine.barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._engine.broadcast(obj, src)


for _name in OPTION_ATTRIBUTES:
    setattr(MiCSFrontEnd, _name, _Option(_name))
