"""Private torch.distributed.checkpoint APIs the checkpoint package relies on (merged into _compat at merge)."""

from torch.distributed.checkpoint._traverse import set_element  # noqa: F401
from torch.distributed.checkpoint.default_planner import (  # noqa: F401
    _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into  # noqa: F401
