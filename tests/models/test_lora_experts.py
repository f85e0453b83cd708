"""LoRA on a Mixture-of-Experts model's fused experts (``lora.target_parameters``: peft's ``ParamWrapper``) on the
builtin tiny-moe: the adapters start as the plain model and only they train, the merged experts are peft's own merge
computed out of place, serve the trained model and split per expert for the weight sync, and set-up refuses what
cannot work, naming the keys."""

import copy

import pytest
import torch

from rlhf_core.config import LoraConfig
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.models.checkpoint_names import checkpoint_pieces
from rlhf_core.models.lora import (
    LoraTargetError,
    ParamScaling,
    adapted_parameters,
    lora_layers,
    merged_state_dict,
    merged_tensors,
    plain_name,
)

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ONLY_EXPERTS = LoraConfig(rank=4, alpha=8.0, target_modules=[], target_parameters=EXPERTS)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


def _moe(tok, lora=ONLY_EXPERTS):
    return build_causal_lm("builtin:tiny-moe", tok, seed=0, dtype=torch.float32, attn="sdpa", lora=lora)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 500, (2, 11), generator=torch.Generator().manual_seed(seed))


def _peft_merged(model) -> dict[str, torch.Tensor]:
    """peft's own in-place merge of every ParamWrapper, on a copy: each weight by its plain name."""
    from peft.tuners.lora.layer import ParamWrapper

    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, ParamWrapper):
            module.merge()
    return {plain_name(n): p.detach() for n, p in twin.named_parameters() if ".lora_" not in n}


def test_expert_adapters_start_as_the_plain_model_and_only_they_train(tok):
    plain, model = _moe(tok, lora=None), _moe(tok)
    layers = lora_layers(model)
    assert all(isinstance(s, ParamScaling) and s == 2.0 for s in layers.values())
    assert sorted(adapted_parameters(model)) == sorted(f"model.layers.{i}.{p}" for i in (0, 1) for p in EXPERTS)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, plain(_ids()).logits)  # B = 0
    assert [t.name for t in merged_tensors(model)] == [n for n, _ in plain.named_parameters()]
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert set(adapters) == {n for n in adapters if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 8 and all(".mlp.experts." in n for n in adapters)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for seed in (0, 1):
        ids = _ids(seed)
        model(input_ids=ids, labels=ids).loss.backward()
        if seed == 0:  # B = 0: the gradient reaches every B (every expert's block of columns), A's is zero
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    e = layers[n.split(".lora_B.")[0]]
                    blocks = p.grad.reshape(p.shape[0], -1, p.shape[1] // 4).abs().sum(dim=(0, 1))
                    assert isinstance(e, ParamScaling) and bool((blocks > 0).all()), n
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items())  # every base weight bit for bit
    assert all(not torch.equal(after[n], v) for n, v in adapters.items())


def test_the_merged_experts_are_peft_merge_out_of_place_and_split_per_expert(tok):
    model = _moe(tok)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {t.name: t.value() for t in merged_tensors(model)}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # out of place
    reference = _peft_merged(model)
    assert merged.keys() == reference.keys()
    for name in adapted_parameters(model):
        assert (merged[name] - reference[name]).abs().max().item() < 1e-6, name
        assert not torch.equal(merged[name], before[name.replace("experts.", "experts.base_layer.base_layer.")])
    assert all(torch.equal(merged[k], reference[k]) for k in merged)  # here bit for bit, every weight
    # the export's merge, from the state dict alone, is the same
    state = merged_state_dict(model.state_dict(), lora_layers(model))
    assert state.keys() == merged.keys() and all(torch.equal(state[k], merged[k]) for k in merged)
    # the plain model holding the merged weights computes what the adapted model computes
    plain = _moe(tok, lora=None)
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert (plain(_ids(2)).logits - model(_ids(2)).logits).abs().max().item() < 1e-5
    # the weight sync's pieces: one matrix per expert and projection, cut from the merged tensor
    experts, inner = model.config.num_experts, model.config.moe_intermediate_size
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    pieces = dict(checkpoint_pieces(model, gate_up, merged[gate_up]))
    assert len(pieces) == 2 * experts
    for e in range(experts):
        prefix = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(pieces[f"{prefix}.gate_proj.weight"], merged[gate_up][e, :inner])
        assert torch.equal(pieces[f"{prefix}.up_proj.weight"], merged[gate_up][e, inner:])
    down = "model.layers.1.mlp.experts.down_proj"
    pieces = dict(checkpoint_pieces(model, down, merged[down]))
    assert len(pieces) == experts
    assert all(
        torch.equal(pieces[f"model.layers.1.mlp.experts.{e}.down_proj.weight"], merged[down][e])
        for e in range(experts)
    )


@pytest.fixture(scope="module")
def world():
    """A one-rank torch.distributed world in this process, for DeepSpeed engines; ended after the module."""
    from tests.config_keys.fakes import end_one_rank_world, one_rank_world

    one_rank_world()
    yield
    end_one_rank_world()


def test_a_zero2_step_trains_the_expert_adapters_and_the_export_is_the_trained_model(tok, world, tmp_path):
    """The project's DeepSpeed strategy (ZeRO-2): two steps move every expert adapter and no base weight; the
    exported folder (the experts merged from the state dict) loads as the plain model computing the same logits."""
    from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
    from rlhf_core.distributed.strategy import DeepSpeedStrategy
    from tests.models.test_lora import check_merged_export

    model = _moe(tok)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    strategy = DeepSpeedStrategy(
        StrategyConfig(zero_stage=2, precision="fp32"),
        OptimConfig(lr=1e-2, lr_warmup_ratio=0.0, max_norm=0.0),
        TrainConfig(train_batch_size=2, micro_train_batch_size=2),
    )
    strategy.init_distributed()
    engine = strategy.prepare(model, total_steps=10)
    for seed in (0, 1):
        ids = _ids(seed)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items())
    assert all(not torch.equal(after[n], v) for n, v in adapters.items())
    check_merged_export(strategy, engine, tok, tmp_path / "merged")


def test_all_linear_reaches_the_fused_experts_and_router_as_peft_maps_them(tok):
    """peft 0.21 maps all-linear on a model it knows from transformers 4 (Qwen2/3-MoE, Mixtral) to the fused
    experts and the router weight as well (rank 2r on gate_up_proj, which fuses two projections): they merge too."""
    model = _moe(tok, lora=LoraConfig(rank=4, alpha=8.0))
    assert sorted(adapted_parameters(model)) == sorted(
        f"model.layers.{i}.{p}" for i in (0, 1) for p in [*EXPERTS, "mlp.gate.weight"]
    )
    assert model.model.layers[0].mlp.experts.base_layer.r["default"] == 8
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
    merged, reference = {t.name: t.value() for t in merged_tensors(model)}, _peft_merged(model)
    for name in adapted_parameters(model):
        assert (merged[name] - reference[name]).abs().max().item() < 1e-6, name
    with pytest.raises(LoraTargetError, match=r"lora.dropout 0.1: adapters on whole parameters"):
        _moe(tok, lora=LoraConfig(rank=4, dropout=0.1))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["sft.model.lora.target_modules=[q_proj]", "sft.model.lora.target_parameters=[mlp.experts.nope]"],
            r"'sft.model.lora.target_parameters' \['mlp.experts.nope'\]: 'mlp.experts.nope' matches no parameter",
        ),
        (
            ["sft.model.lora.target_parameters=[mlp.experts.down_proj]", "sft.model.lora.dropout=0.1"],
            r"'sft.model.lora.target_parameters' adapts whole parameters, whose adapters take no dropout \(peft\): "
            r"set 'sft.model.lora.dropout' to 0",
        ),
        (
            [
                "sft.model.lora.target_modules=[q_proj]",
                "sft.model.lora.target_parameters=[mlp.experts.down_proj]",
                "sft.strategy.zero_stage=3",
            ],
            r"'sft.model.lora.target_parameters' adapts whole parameters \(model.layers.0.mlp.experts.down_proj, "
            r"\.\.\. 2 in all\), which ZeRO-3 cannot partition under peft's wrapper: set 'sft.strategy.zero_stage' "
            r"to 2 or lower",
        ),
        (
            ["sft.strategy.zero_stage=3"],
            r"'sft.model.lora.target_modules' adapts whole parameters .* set 'sft.strategy.zero_stage' to 2 or lower",
        ),
    ],
)
def test_bad_expert_targets_are_refused_naming_the_keys_before_any_worker_starts(overrides, message, tmp_path):
    from rlhf_core.config import ConfigError, load_config
    from rlhf_core.jobs import stage_setup
    from tests.conftest import TINY

    base = [f"run_uri={tmp_path}", "sft.model.name_or_path=builtin:tiny-moe", "sft.model.lora.rank=4"]
    with pytest.raises(ConfigError, match=message):
        stage_setup.setup_stage(load_config(TINY, [*base, *overrides]), "sft")


def test_the_default_leaves_the_stage_hash_as_it_was():
    """A LoRA stage hashes as it did before the key existed (a LoraConfig without it), and naming experts changes
    its hash."""
    from dataclasses import field, fields, make_dataclass, replace
    from functools import partial

    from rlhf_core.config import load_config
    from rlhf_core.config.hashing import stage_hash
    from tests.conftest import TINY

    section = load_config(TINY, ["sft.model.lora.rank=4"]).stage("sft")
    lora = section.model.lora
    older = make_dataclass(
        "LoraConfig",
        [
            (f.name, f.type, field(default_factory=partial(copy.deepcopy, getattr(lora, f.name))))
            for f in fields(lora)
            if f.name != "target_parameters"
        ],
    )()
    assert stage_hash(replace(section, model=replace(section.model, lora=older))) == stage_hash(section)
    changed = replace(section, model=replace(section.model, lora=replace(lora, target_parameters=EXPERTS)))
    assert stage_hash(changed) != stage_hash(section)
