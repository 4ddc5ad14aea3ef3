"""Streaming DiLoCo's fragments follow modules: cut between FSDP units by default (also where the element-count cut
falls inside a block), one per named module with `fragment_modules`, by element count only as a stated fallback;
the options' refusals. Pure functions, no processes."""

from __future__ import annotations

import pytest
from toy import ToyLM

from lightning_mics import MiCSOptions
from lightning_mics.hop2.fragments import fragment_bounds, module_fragments, named_fragments, owning_unit

TOY_UNITS = ["blocks.0", "blocks.1", "blocks.2"]


def toy_trained() -> tuple[list[str], list[int]]:
    model = ToyLM()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p.numel() for _, p in named]


def test_three_fragments_of_the_toy_model_do_not_cut_a_block_where_the_element_count_would() -> None:
    names, numels = toy_trained()
    by_elements = [[names[i] for i in range(a, b)] for a, b in fragment_bounds(numels, 3)]
    # the element-count cut splits block 0: its mix layer in one fragment, its gate in the next
    assert any(
        {owning_unit(n, TOY_UNITS) for n in left} & {owning_unit(n, TOY_UNITS) for n in right}
        for left, right in zip(by_elements, by_elements[1:])
    )
    fragments, fallback = module_fragments(names, numels, 3, TOY_UNITS)
    assert fallback is None
    owners = [[owning_unit(names[i], TOY_UNITS) for i in f] for f in fragments]
    for left, right in zip(owners, owners[1:]):
        assert not set(left) & set(right), owners  # no unit in two fragments
    assert sorted(i for f in fragments for i in f) == list(range(len(names)))
    # each cut at the unit boundary nearest its share (213 and 427 of 640 elements): embedding | blocks 0-1 | block 2
    assert [sum(numels[i] for i in f) for f in fragments] == [110, 320, 210]


def test_cuts_go_to_the_nearest_boundary_and_fall_back_to_elements_when_there_are_too_few() -> None:
    names = ["a.w", "a.b", "b.w", "c.w", "c.b", "d.w"]
    fragments, fallback = module_fragments(names, [40, 40, 10, 5, 5, 100], 2, ["a", "b", "c", "d"])
    assert fallback is None and fragments == [[0, 1, 2, 3, 4], [5]]  # 100 | 100: exactly half
    fragments, fallback = module_fragments(names, [40, 40, 10, 5, 5, 100], 4, ["a", "b", "c", "d"])
    assert fallback is None and fragments == [[0, 1], [2], [3, 4], [5]]  # every boundary used
    fragments, fallback = module_fragments(["x.w", "x.b", "x.c"], [10, 10, 10], 2, ["x"])
    assert fragments == [[0, 1], [2]] and "by element count" in fallback and "fragment_modules" in fallback
    assert module_fragments(names, [1] * 6, 1, ["a"]) == ([list(range(6))], None)


def test_named_fragments_take_every_parameter_in_the_users_order() -> None:
    names = ["model.embed.weight", "model.blocks.0.mix.weight", "model.blocks.1.mix.weight", "model.norm.weight"]
    # the embedding (before any named module) joins the first fragment, the norm the fragment of block 1 before it
    assert named_fragments(names, ["model.blocks.1", "model.blocks.0"]) == [[0, 2, 3], [1]]
    # the most specific name wins where names nest
    assert named_fragments(names, ["model", "model.blocks.1"]) == [[0, 1, 3], [2]]
    with pytest.raises(ValueError, match=r"fragment_modules names \['model.head'\], which hold\(s\) no parameter"):
        named_fragments(names, ["model.blocks.0", "model.head"])


def test_the_options_check_fragment_modules() -> None:
    base = {"cross_replica_sync": "diloco", "sync_every": 4, "num_fragments": 2}
    options = MiCSOptions(**base, fragment_modules=["model.blocks.0", "model.blocks.1"])
    assert options.fragment_modules == ("model.blocks.0", "model.blocks.1")
    with pytest.raises(ValueError, match="names 3 module\\(s\\), one per fragment: set num_fragments=3"):
        MiCSOptions(**base, fragment_modules=["a", "b", "c"])
    with pytest.raises(ValueError, match="more than once"):
        MiCSOptions(**base, fragment_modules=["a", "a"])
    with pytest.raises(ValueError, match="must be a list of module names"):
        MiCSOptions(**base, fragment_modules="a")
    with pytest.raises(ValueError, match="fragment_modules only applies to semi-synchronous"):
        MiCSOptions(fragment_modules=["a"])

