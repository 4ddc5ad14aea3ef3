"""What ``auto_wrap_policy`` (and ``activation_checkpointing_policy``) may be, and the one normalisation of it.

Declared apart from :mod:`lightning_mics.wrapping`, which shards modules, so that the options
(:mod:`lightning_mics.options`) check a policy when they are created without importing FSDP.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, Union

from torch import nn

#: A callable ``(module_name, module) -> bool`` that says whether to wrap ``module``.
WrapPredicate = Callable[[str, nn.Module], bool]
#: What users may pass as ``auto_wrap_policy``: ``None``/``True`` (the default rules, see
#: :func:`plan_wrapping`), module classes, a callable predicate, or ``False``/empty to wrap only the root.
AutoWrapPolicy = Union[None, bool, type[nn.Module], Iterable[type[nn.Module]], WrapPredicate]


def wrap_module_list_children(name: str, module: nn.Module, parent: nn.Module | None = None) -> bool:
    """Default predicate: wrap every child of an ``nn.ModuleList`` that owns parameters."""
    return isinstance(parent, nn.ModuleList) and any(True for _ in module.parameters())


def make_wrap_predicate(policy: AutoWrapPolicy) -> Callable[[str, nn.Module, nn.Module | None], bool]:
    """Normalise the user's ``auto_wrap_policy`` into ``predicate(name, module, parent)``.

    Raises:
        TypeError: when the policy is not one of the accepted forms.
    """
    if policy is None or policy is True:
        return wrap_module_list_children
    if policy is False:
        return lambda name, module, parent: False
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = (policy,)
    if isinstance(policy, (list, tuple, set, frozenset)):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"auto_wrap_policy entries must be nn.Module subclasses, got {bad!r}.")
        return lambda name, module, parent: isinstance(module, classes)
    if callable(policy):
        _check_predicate_signature(policy)
        user_predicate = policy
        return lambda name, module, parent: bool(user_predicate(name, module))
    raise TypeError(
        f"auto_wrap_policy={policy!r} is not supported. Pass None (wrap nn.ModuleList children), a module class or "
        "a list of module classes, a callable (name, module) -> bool, or False (wrap only the root)."
    )


def _check_predicate_signature(policy: Callable[..., Any]) -> None:
    """A policy callable is called as ``policy(name, module)``: refuse one that cannot be, now,
    rather than with a TypeError from deep inside the model setup."""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        signature.bind("blocks.0", nn.Module())
    except TypeError:
        raise TypeError(
            f"auto_wrap_policy callable {getattr(policy, '__name__', policy)!r}{signature} cannot be called as "
            "policy(name, module): it must take the module's qualified name and the module and return True to wrap "
            "it, e.g. `lambda name, module: isinstance(module, Block)`."
        ) from None
