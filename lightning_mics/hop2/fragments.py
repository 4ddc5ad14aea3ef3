"""How streaming DiLoCo cuts the trained parameters into fragments, synchronised in turn.

Why along modules: a fragment is synchronised at its own step, so its parameters come from one moment of the
global model and the others from another. A cut inside a module (a block's attention from one round, its MLP
from the next) mixes two moments inside one computation; torchft's streaming DiLoCo avoids it by synchronising
the modules the user names. Here, by default, fragments follow the model's FSDP units (transformer blocks): the
cuts fall only between units, at the unit boundaries nearest to equal element counts. A user may name the
modules of each fragment instead (``fragment_modules``), in the order they synchronise. Where a model has fewer
unit boundaries than cuts, the element-count cut is the fallback, and the run says so.

Every function is pure (parameter names and sizes in, index lists out), run on the global sizes, so every rank
and every replica cuts alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

#: A fragment: the indices (into the optimizer's parameter order) of the parameters it synchronises.
Fragment = list[int]


def fragment_bounds(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """Cut parameters of ``numels`` elements (in order) into ``fragments`` contiguous runs of about equal elements:
    ``(start, stop)`` index ranges, none empty -- the element-count cut."""
    if fragments > len(numels):
        raise ValueError(
            f"num_fragments={fragments} is more than the {len(numels)} trained parameter tensors of this optimizer: "
            "lower it."
        )
    total = sum(numels)
    bounds, start, running = [], 0, 0
    for index, numel in enumerate(numels):
        running += numel
        still_to_cut = fragments - 1 - len(bounds)
        after = len(numels) - index - 1  # tensors after this one: each later fragment needs one
        reached_its_share = running >= total * (len(bounds) + 1) / fragments
        if still_to_cut and after >= still_to_cut and (reached_its_share or after == still_to_cut):
            bounds.append((start, index + 1))
            start = index + 1
    bounds.append((start, len(numels)))
    return bounds


def owning_unit(name: str, unit_names: Sequence[str]) -> str:
    """The FSDP unit a parameter named ``name`` belongs to: the longest unit name that prefixes it (``""``: the
    root unit)."""
    owners = [unit for unit in unit_names if unit and (name == unit or name.startswith(unit + "."))]
    return max(owners, key=len, default="")


def module_fragments(
    names: Sequence[str], numels: Sequence[int], fragments: int, unit_names: Sequence[str]
) -> tuple[list[Fragment], Optional[str]]:
    """``fragments`` contiguous runs cut only where the owning FSDP unit changes, each cut at the unit boundary
    whose running element count is nearest its equal share; and ``None`` -- or, where there are fewer unit
    boundaries than cuts, the element-count cut and the reason it was taken."""
    if fragments == 1:
        return [list(range(len(names)))], None
    owners = [owning_unit(name, unit_names) for name in names]
    boundaries = [i for i in range(1, len(names)) if owners[i] != owners[i - 1]]
    if len(boundaries) < fragments - 1:
        reason = (
            f"num_fragments={fragments} needs {fragments - 1} cuts but the model's parameters change FSDP unit only "
            f"{len(boundaries)} time(s): the fragments are cut by element count, some inside a module "
            "(fragment_modules=[...] names the modules of each fragment)"
        )
        return [list(range(a, b)) for a, b in fragment_bounds(numels, fragments)], reason
    running = [0]
    for numel in numels:
        running.append(running[-1] + numel)
    total = running[-1]
    cuts: list[int] = []
    for k in range(1, fragments):
        # the boundaries left for this cut: after the previous one, leaving one for each later cut
        left = [b for b in boundaries if (not cuts or b > cuts[-1])]
        choices = left[: len(left) - (fragments - 1 - k)]
        cuts.append(min(choices, key=lambda b: (abs(running[b] - total * k / fragments), b)))
    edges = [0, *cuts, len(names)]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:])], None


def named_fragments(names: Sequence[str], fragment_modules: Sequence[str]) -> list[Fragment]:
    """One fragment per name in ``fragment_modules``: the parameters under that module. A parameter under none of
    them joins the fragment of the parameter before it (the first fragment where none is), so every trained
    parameter is synchronised. A named module that holds none of the parameters is refused."""
    chosen: list[Fragment] = [[] for _ in fragment_modules]
    previous = 0
    for index, name in enumerate(names):
        matches = [f for f, module in enumerate(fragment_modules) if name == module or name.startswith(module + ".")]
        if matches:  # the most specific name wins where names nest
            previous = max(matches, key=lambda f: len(fragment_modules[f]))
        chosen[previous].append(index)
    empty = [
        module for module in fragment_modules
        if not any(name == module or name.startswith(module + ".") for name in names)
    ]
    empty += [module for module, members in zip(fragment_modules, chosen) if not members and module not in empty]
    if empty:
        raise ValueError(
            f"fragment_modules names {empty}, which hold(s) no parameter this optimizer trains; name modules of the "
            f"model (its trained parameters start with e.g. {sorted({n.rsplit('.', 1)[0] for n in names})[:4]})."
        )
    return chosen


__all__ = ["Fragment", "fragment_bounds", "module_fragments", "named_fragments", "owning_unit"]
