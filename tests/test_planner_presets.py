"""The planner's models and what `lightning-mics plan` prints: published shapes and their parameter counts,
`--hf-config` on a local config.json, `--params` alone refused, near-ties broken toward less memory and said
so, each row's accumulation mode, infeasible layouts summarised, and the winner as a `MiCSStrategy(...)` to
paste. All pure (no processes)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lightning_mics.plan import main as plan_main
from lightning_mics.planner import (
    CLUSTER_PRESETS,
    GIB,
    MODEL_PRESETS,
    MODEL_SHAPES,
    ModelSpec,
    TrainingSpec,
    activation_bytes,
    plan,
    read_hf_config,
)
from lightning_mics.planner.ties import lost_because, near_ties

DONE_WHEN = ["--model", "llama-3-8b", "--nodes", "4", "--gpus-per-node", "8", "--cluster", "p4d"]
MODES = ("sharded", "unsharded", "replicated")

#: The parameter counts the models' cards (and `sum(p.numel())` of the Hugging Face models) state.
PUBLISHED_COUNTS = {
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}

#: meta-llama/Meta-Llama-3-8B's config.json as published (keys the planner does not read included)
LLAMA_3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

#: openai-community/gpt2-medium's config.json (abridged to the keys that describe the shape, n_inner null)
GPT2_MEDIUM_CONFIG: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 1024,
    "n_head": 16,
    "n_inner": None,
    "n_layer": 24,
    "n_positions": 1024,
    "vocab_size": 50257,
}


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert plan_main(list(args)) == 0
    return capsys.readouterr().out


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exited:
        plan_main(list(args))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _flat(out: str) -> str:
    """The output with its notes' line wrapping undone, for checks of their sentences."""
    return " ".join(out.split())


def _table_rows(out: str) -> list[list[str]]:
    """The ranked table's rows, split on its column gaps (two spaces or more)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  "))
    rows = []
    for line in lines[start + 2 :]:
        if not re.match(r"^\d+\s", line):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def _strategy_line(out: str) -> str:
    lines = out.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("The winner as a strategy"))
    return lines[index + 1].strip()


def _options_of(line: str) -> Any:
    """The pasted line, built: as the strategy (it must construct) and as its options (to read them)."""
    from lightning_mics import MiCSOptions, MiCSStrategy, ShardingSpec

    names = {"MiCSStrategy": MiCSStrategy, "ShardingSpec": ShardingSpec}
    eval(line, names)  # the planner's own output: it must be valid code
    return eval(line.replace("MiCSStrategy(", "MiCSOptions(", 1), {**names, "MiCSOptions": MiCSOptions})


# ------------------------------------------------------------------------------------ the models
@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_published_shapes_give_the_published_parameter_counts(name: str) -> None:
    assert MODEL_SHAPES[name].params == PUBLISHED_COUNTS[name]
    spec = MODEL_PRESETS[name]
    assert spec.params == PUBLISHED_COUNTS[name] and spec.fused_attention
    assert spec.seq_len == min(2048, MODEL_SHAPES[name].max_positions)  # the documented default


def test_the_papers_presets_are_kept() -> None:
    assert {"bert-10b", "gpt-1.3b", "gpt-13b", "gpt-175b"} <= set(MODEL_PRESETS)
    assert MODEL_PRESETS["bert-10b"] == ModelSpec(
        params=10_000_000_000, layers=127, hidden=2560, seq_len=512, heads=40, name="bert-10b"
    )


def test_activation_memory_follows_grouped_query_attention_and_the_gated_mlp() -> None:
    gpt = ModelSpec(params=1, layers=2, hidden=1024, seq_len=512, heads=8, fused_attention=True)
    training = TrainingSpec(micro_batch=2)
    sbh = 512 * 2 * 1024
    assert activation_bytes(gpt, training) == pytest.approx(2 * 34 * sbh)  # Korthikanti's 34 sbh, unchanged
    llama = replace(gpt, kv_heads=2, intermediate=3584, gated_mlp=True)
    # attention 7 + 4 * 2/8, gated MLP 2 + 8 * 3.5, norms 4
    assert activation_bytes(llama, training) == pytest.approx(2 * (8 + 30 + 4) * sbh)


def test_hf_config_reads_a_local_llama_and_gpt2_config(tmp_path: Path) -> None:
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    from_folder = read_hf_config(tmp_path / "llama")  # a model folder works as well as its file
    assert replace(from_folder, name="llama-3-8b", source="") == replace(MODEL_SHAPES["llama-3-8b"], source="")
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2_MEDIUM_CONFIG))
    gpt2 = read_hf_config(tmp_path / "gpt2.json")
    assert gpt2.params == PUBLISHED_COUNTS["gpt2-medium"] and gpt2.intermediate == 4096


def test_hf_config_gives_the_same_plan_as_the_matching_preset(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B_CONFIG))
    common = ["--nodes", "4", "--gpus-per-node", "8", "--cluster", "p4d", "--json", "--top", "0"]
    preset = json.loads(_run(capsys, "--model", "llama-3-8b", *common))
    read = json.loads(_run(capsys, "--hf-config", str(config), *common))
    assert {**read["model"], "name": "llama-3-8b"} == preset["model"]
    assert read["ranked"] == preset["ranked"] and read["strategy"] == preset["strategy"]
    # the printed table and strategy too, from the first row of the table on
    table = _run(capsys, *DONE_WHEN)
    from_file = _run(capsys, "--hf-config", str(config), "--nodes", "4", "--gpus-per-node", "8", "--cluster", "p4d")
    assert from_file.split("\n#", 1)[1] == table.split("\n#", 1)[1]
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps(GPT2_MEDIUM_CONFIG))
    args = ["--cluster", "p4d", "--nodes", "2", "--accumulation", "4", "--grad-accumulation", "auto", "--json"]
    assert json.loads(_run(capsys, "--hf-config", str(gpt2), *args))["ranked"] == json.loads(
        _run(capsys, "--model", "gpt2-medium", *args)
    )["ranked"]


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({**LLAMA_3_8B_CONFIG, "model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
        ({**LLAMA_3_8B_CONFIG, "model_type": "falcon"}, "model_type 'falcon' is not one the planner reads"),
        ({k: v for k, v in LLAMA_3_8B_CONFIG.items() if k != "num_hidden_layers"}, "lacks num_hidden_layers"),
        ({"model_type": "llava", "text_config": {"hidden_size": 4096}}, "multimodal"),
        ({**LLAMA_3_8B_CONFIG, "num_key_value_heads": 7}, "cannot share 7 key/value heads"),
    ],
)
def test_hf_config_refusals_name_the_way_out(tmp_path: Path, capsys, config: dict[str, Any], fragment: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert fragment in _refused(capsys, "--hf-config", str(path), "--cluster", "p4d")


def test_hf_config_that_is_not_there_or_not_json(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing" / "config.json"
    assert "config.json" in _refused(capsys, "--hf-config", str(missing), "--cluster", "p4d")
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    assert "is not JSON" in _refused(capsys, "--hf-config", str(broken), "--cluster", "p4d")
    assert "not both" in _refused(capsys, "--hf-config", str(broken), "--model", "gpt2", "--cluster", "p4d")


def test_params_alone_is_refused_naming_the_presets_of_about_that_size(capsys) -> None:
    err = _refused(capsys, "--cluster", "p4d", "--nodes", "4", "--params", "7B")
    assert "does not give the model's shape" in err and "--model" in err and "--hf-config" in err
    assert "llama-2-7b (6.74B)" in err and "mistral-7b (7.24B)" in err
    # with the shape beside it, a count is a custom model, as before
    out = _run(capsys, "--cluster", "p4d", "--nodes", "4", "--params", "7B", "--layers", "32", "--hidden", "4096")
    assert "7,000,000,000 params, 32 layers x 4096" in out and "4224" not in out
    assert "name the model" in _refused(capsys, "--cluster", "p4d", "--layers", "32")


def test_shape_flags_on_a_preset_recompute_its_count_and_seq_len_is_bounded(capsys) -> None:
    halved = replace(MODEL_SHAPES["llama-3-8b"], layers=16)
    data = json.loads(_run(capsys, "--model", "llama-3-8b", "--layers", "16", "--cluster", "p4d", "--json"))
    assert data["model"]["params"] == halved.params and data["model"]["layers"] == 16
    long = json.loads(_run(capsys, "--model", "llama-3-8b", "--seq-len", "8192", "--cluster", "p4d", "--json"))
    assert long["model"]["seq_len"] == 8192
    err = _refused(capsys, "--model", "llama-3-8b", "--seq-len", "16384", "--cluster", "p4d")
    assert "longer than llama-3-8b's 8192 positions" in err
    eager = json.loads(_run(capsys, "--model", "gpt2", "--attention", "eager", "--cluster", "p4d", "--json"))
    assert eager["model"]["fused_attention"] is False and eager["model"]["seq_len"] == 1024


# ------------------------------------------------------------------------------------ what the CLI prints
def test_done_when_a_ranked_table_with_modes_and_the_winner_to_paste(capsys) -> None:
    out = _run(capsys, *DONE_WHEN)
    assert "model: llama-3-8b, 8,030,261,248 params, 32 layers x 4096, 32 heads (8 kv), MLP 14336 gated" in out
    header = next(line for line in out.splitlines() if line.startswith("#  "))
    assert "grad acc" in header and "fits" not in header  # only layouts that fit are listed
    rows = _table_rows(out)
    assert len(rows) == 15 and all(row[2] in MODES for row in rows)
    assert not any(row[-1] == "NO" for row in rows)
    assert re.search(r"\d+ more layouts do not fit in 36.0 GiB usable per GPU .*--show-infeasible", _flat(out))
    line = _strategy_line(out)
    assert line.startswith("MiCSStrategy(")
    expected = plan(
        CLUSTER_PRESETS["p4d"].with_nodes(4), MODEL_PRESETS["llama-3-8b"], TrainingSpec()
    ).winner.layout
    options = _options_of(line)
    spec = options.sharding
    degrees = (spec.params, spec.grads, spec.optim) if spec is not None else (options.partition_size,) * 3
    assert degrees == (expected.params, expected.grads, expected.optim)
    assert "with Trainer(num_nodes=4, devices=8, precision='bf16-mixed')" in out
    # the wording the table and explanation used to get wrong
    assert "ZeRO-3 ZeRO-3" not in out and "1.00x" not in out and "vs ZeRO-3 (P=32 G=32 OS=32 hier)" in out


def test_show_infeasible_lists_them_with_a_fits_column(capsys) -> None:
    out = _run(capsys, *DONE_WHEN, "--show-infeasible", "--top", "0")
    header = next(line for line in out.splitlines() if line.startswith("#  "))
    rows = _table_rows(out)
    assert header.rstrip().endswith("fits") and {row[-1] for row in rows} == {"yes", "NO"}
    assert "--show-infeasible lists them" not in out


def test_with_grad_accumulation_auto_every_row_states_its_mode(capsys) -> None:
    out = _run(capsys, "--model", "gpt2-xl", "--cluster", "p4d", "--nodes", "2", "--accumulation", "4",
               "--grad-accumulation", "auto", "--top", "0")
    assert "grad accumulation auto (each row says which mode it priced)" in out
    modes = [row[2] for row in _table_rows(out)]
    assert set(modes) == set(MODES)  # both modes of sharded layouts, and G=1 as whole gradients
    assert "unsharded = whole gradients kept until the optimizer step" in _flat(out)
    line = _strategy_line(out)
    assert f"grad_accumulation={_options_of(line).grad_accumulation!r}" in line
    single = _run(capsys, "--model", "gpt2-xl", "--cluster", "p4d", "--nodes", "2", "--grad-accumulation", "auto")
    assert "the two modes are one schedule" in _flat(single) and "grad_accumulation" not in _strategy_line(single)


def test_near_ties_go_to_less_memory_and_the_table_says_so(capsys) -> None:
    """The case the planner used to get wrong: a ZeRO-2-like layout predicted 0.1 % faster than leaner ones,
    9.5 GiB more memory per GPU."""
    cluster, training = CLUSTER_PRESETS["p4d"].with_nodes(4), TrainingSpec(activation_checkpointing=True)
    model = ModelSpec(params=7_000_000_000, layers=32, hidden=4096, seq_len=4096)
    result = plan(cluster, model, training)
    fastest, winner = near_ties(result.ranked)[0], result.winner
    assert fastest is not winner and winner.step_time_s <= fastest.step_time_s * 1.02
    assert fastest.layout.params == 1 and winner.memory.total < fastest.memory.total - 5 * GIB
    assert "needs 9.5 GiB more per GPU" in (lost_because(fastest, winner, result.near_ties) or "")
    # memory differences within the memory tolerance are noise too: then the fastest of them wins
    loose = plan(cluster, model, training, memory_tie_tolerance=0.5)
    assert loose.winner is not None and loose.winner.layout == fastest.layout
    out = _run(capsys, "--cluster", "p4d", "--nodes", "4", "--params", "7B", "--layers", "32", "--hidden", "4096",
               "--seq-len", "4096", "--activation-checkpointing")
    assert "~ a tie:" in out and "then the least memory per GPU" in _flat(out)
    assert "is predicted 0.1 % faster than #1 but lost the tie because it needs 9.5 GiB more per GPU" in _flat(out)
    rows = _table_rows(out)
    assert rows[0][4] == "~" and rows[1][4].endswith("~")  # the tied rows are marked
    assert "predicted 0.1 % faster" in out and "within the 2 % tie, but it needs 9.5 GiB more" in _flat(out)


def test_a_plan_where_nothing_fits_names_the_checkpointed_layout(capsys) -> None:
    out = _run(capsys, "--model", "llama-3-8b", "--cluster", "p4d", "--seq-len", "8192")
    assert "No layout fits" in out and "no strategy to recommend" in out
    checkpointed = r"With --activation-checkpointing it fits: .*MiCSStrategy\(.*activation_checkpointing_policy=True\)"
    assert re.search(checkpointed, out)
    memories = [float(row[-2]) for row in _table_rows(out)]  # the column before "fits"
    assert memories == sorted(memories)  # the leanest first: how far each is from fitting


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--cross-replica-dtype", "bf16"], {"cross_replica_dtype": "bf16", "grad_accumulation": "sharded"}),
        (["--activation-checkpointing"], {"activation_checkpointing_policy": True}),
        (["--sync-every", "8", "--inter-bandwidth", "1Gbps"], {"cross_replica_sync": "diloco", "sync_every": 8}),
    ],
)
def test_the_strategy_line_carries_every_setting_the_plan_priced(capsys, extra: list[str], expected: dict) -> None:
    args = ["--model", "gpt2-xl", "--cluster", "p4d", "--nodes", "2", "--accumulation", "2", "--json"]
    data = json.loads(_run(capsys, *args, *extra))
    options = _options_of(data["strategy"])
    for name, value in expected.items():
        assert getattr(options, name) == value, (name, data["strategy"])


def test_the_strategy_line_of_a_flat_partition_across_nodes_says_hierarchical_false() -> None:
    cluster, model = CLUSTER_PRESETS["p4d"].with_nodes(2), MODEL_PRESETS["gpt2-xl"]
    flat = plan(cluster, model, TrainingSpec(), uniform_only=True, hierarchical=False, partition_size=16)
    line = flat.strategy_line()
    assert line == "MiCSStrategy(partition_size=16, hierarchical=False)"
    assert _options_of(line).hierarchical is False
    spanning = plan(cluster, model, TrainingSpec(), uniform_only=True, partition_size=16)
    assert spanning.strategy_line() == "MiCSStrategy(partition_size=16)"  # two-stage: the strategy's default
