"""LoRA adapters (``rlhf_core.models.lora``) on the builtin tiny models: they start as the plain model, only they (and
a value head) train under the project's DeepSpeed strategy, a checkpoint holds them and restores the same logits, the
merged export is the trained model, and merging for a sync is out of place. An adapter export (``lora.export:
adapter``) reloads to the trained model through the project's loader and plain peft, also as a ``stage:`` reference.
The live sync into vLLM is in ``tests/distributed/test_engine_placement.py``."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.config import LoraConfig, OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed.checkpoints import export_hf
from rlhf_core.distributed.strategy import DeepSpeedStrategy
from rlhf_core.models.builders import ScalarHeadModel, build_causal_lm, build_scalar_model, load_tokenizer
from rlhf_core.models.lora import LoraTargetError, lora_layers, merged_state_dict, merged_tensors, merged_weight
from tests.config_keys.fakes import end_one_rank_world, one_rank_world

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def world():
    """A one-rank torch.distributed world in this process, for DeepSpeed engines; ended after the module."""
    one_rank_world()
    yield
    end_one_rank_world()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 500, (2, 11), generator=torch.Generator().manual_seed(seed))


def check_merged_export(strategy, engine, tok, folder) -> None:
    """The merged export of a trained engine's model is a plain model (no LoRA names) with the trained logits."""
    with torch.no_grad():
        trained = engine.module(_ids(2)).logits
    path = export_hf(engine.module, strategy.full_state_dict(engine), tok, folder)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        assert (plain(_ids(2)).logits - trained).abs().max().item() < 1e-5


def _lm(tok, lora=LORA, seed=0):
    return build_causal_lm("builtin:tiny", tok, seed=seed, dtype=torch.float32, attn="sdpa", lora=lora)


def _engine(model, lr=1e-2):
    strategy = DeepSpeedStrategy(
        StrategyConfig(zero_stage=2, precision="fp32"),
        OptimConfig(lr=lr, lr_warmup_ratio=0.0, max_norm=0.0),
        TrainConfig(train_batch_size=2, micro_train_batch_size=2),
    )
    strategy.init_distributed()
    return strategy, strategy.prepare(model, total_steps=10)


def _step(engine, seed=0):
    ids = _ids(seed)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def test_adapters_start_as_the_plain_model_and_are_the_only_trainable_weights(tok):
    plain, adapted = _lm(tok, lora=None), _lm(tok)
    with torch.no_grad():
        assert torch.equal(plain(_ids()).logits, adapted(_ids()).logits)  # B = 0: the adapters add nothing yet
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # the merged view: the plain model's names, in its order
    assert [t.name for t in merged_tensors(adapted)] == [n for n, _ in plain.named_parameters()]
    # a value model: the adapters on its backbone, and the head trains whole
    rm = build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa", lora=LORA)
    assert rm.score.weight.requires_grad and not rm.model.embed_tokens.weight.requires_grad
    saved = _lm(tok, lora=LoraConfig(rank=4, modules_to_save=["embed_tokens"]))
    assert saved.model.embed_tokens.weight.requires_grad


def test_targets_that_cannot_be_adapted_are_refused_naming_them(tok):
    with pytest.raises(LoraTargetError, match=r"matches model.embed_tokens \(Embedding\): only nn.Linear"):
        _lm(tok, lora=LoraConfig(rank=4, target_modules=["embed_tokens"]))
    with pytest.raises(LoraTargetError, match=r"lora.target_modules \['qproj'\]: Target modules \{'qproj'\} not"):
        _lm(tok, lora=LoraConfig(rank=4, target_modules=["qproj"]))
    with pytest.raises(LoraTargetError, match=r"lora.modules_to_save \['embed'\]: no module of that name"):
        _lm(tok, lora=LoraConfig(rank=4, modules_to_save=["embed"]))


def test_a_deepspeed_step_moves_the_adapters_only_and_a_checkpoint_restores_them(tok, world, tmp_path):
    model = _lm(tok)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    strategy, engine = _engine(model)
    _step(engine)
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items())  # every base weight bit for bit
    moved = {n for n, v in adapters.items() if not torch.equal(after[n], v)}
    # step 1: B starts at 0, so A gets no gradient (dL/dA = B^T ...) and only B moves; step 2 moves A too
    assert moved == {n for n in adapters if ".lora_B." in n}
    _step(engine, seed=1)
    assert all(torch.equal(after[n], v) for n, v in base.items())
    assert all(not torch.equal(after[n], v) for n, v in adapters.items())
    # the optimizer holds the adapters only (ZeRO-2 keeps them in one flat fp32 partition)
    held = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert held == sum(v.numel() for v in adapters.values())

    strategy.save_checkpoint(engine, str(tmp_path), client_state={"step": 1})
    saved = sorted(p.name for p in (tmp_path / "ds").iterdir())
    module_state = torch.load(tmp_path / "ds" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module_state.keys() == adapters.keys()  # the checkpoint holds what trains, not the base
    with torch.no_grad():
        trained = engine.module(_ids(1)).logits
    fresh_strategy, fresh = _engine(_lm(tok))
    assert fresh_strategy.load_checkpoint(fresh, str(tmp_path))["step"] == 1
    with torch.no_grad():
        assert torch.equal(fresh.module(_ids(1)).logits, trained), saved


def test_the_merged_export_is_the_trained_model(tok, world, tmp_path):
    model = _lm(tok)
    strategy, engine = _engine(model)
    _step(engine)
    check_merged_export(strategy, engine, tok, tmp_path / "merged")
    # a value model's export: backbone merged, head as trained
    rm = ScalarHeadModel(build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa", lora=LORA))
    with torch.no_grad():
        for n, p in rm.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        values = rm(_ids(2))
    rm_path = export_hf(rm, rm.state_dict(), tok, tmp_path / "rm")
    loaded = ScalarHeadModel(AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32))
    with torch.no_grad():
        assert (loaded(_ids(2)) - values).abs().max().item() < 1e-5


def test_merging_for_a_sync_is_out_of_place_and_rounds_once():
    # by hand: W = [[1, 2], [3, 4]], A = [[1, 1]] (1 x 2), B = [[1], [2]] (2 x 1), scaling 0.5:
    # W + 0.5 * B @ A = [[1.5, 2.5], [4, 5]]
    w, a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0], [2.0]])
    assert torch.equal(merged_weight(w, a, b, 0.5), torch.tensor([[1.5, 2.5], [4.0, 5.0]]))
    assert torch.equal(w, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    # bf16: the sum is taken in fp32 and rounded once; 1 + 2**-9 is not a bf16 number (8 bits of mantissa), so an
    # in-place bf16 merge and unmerge drifts, the out-of-place value rounds back to the same
    wb = torch.ones(1, 1, dtype=torch.bfloat16)
    tiny = merged_weight(
        wb, torch.ones(1, 1, dtype=torch.bfloat16), torch.full((1, 1), 2.0**-9, dtype=torch.bfloat16), 1.0
    )
    assert tiny.dtype == torch.bfloat16 and tiny.item() == 1.0


def test_ten_syncs_leave_the_trained_weights_as_they_are(tok):
    model = _lm(tok)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = None
    for _ in range(10):
        values = {t.name: t.value() for t in merged_tensors(model)}
        first = first or values
        assert all(torch.equal(values[k], first[k]) for k in first)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    layers = lora_layers(model)
    assert len(layers) == 14 and set(layers.values()) == {2.0}  # 7 linear layers x 2 blocks, alpha 8 / rank 4
    merged = merged_state_dict(model.state_dict(), layers)
    assert all(torch.equal(merged[k], first[k]) for k in first)


def test_zero3_trains_the_adapters_through_the_chunked_log_probs(tok, world):
    """ZeRO-3 (the adapters built inside zero.Init): the chunked log-probs' checkpointed chunks are recomputed in
    backward with the frozen LM head, which DeepSpeed does not gather for a frozen parameter; it is read once
    instead. Two steps move every adapter, and every base weight stays as built."""
    from rlhf_core.models.forward import causal_lm_logprobs
    from rlhf_core.models.partitioned import full_copies

    strategy = DeepSpeedStrategy(
        StrategyConfig(zero_stage=3, precision="fp32"),
        OptimConfig(lr=1e-2, lr_warmup_ratio=0.0, max_norm=0.0),
        TrainConfig(train_batch_size=2, micro_train_batch_size=2),
    )
    strategy.init_distributed()
    with strategy.model_init():
        model = _lm(tok)
    names = [n for n, _ in model.named_parameters()]
    before = dict(zip(names, full_copies(list(model.parameters()))))
    start = dict(zip(names, full_copies(list(_lm(tok).parameters()))))
    assert all(torch.equal(before[n], start[n]) for n in names)  # the same adapters (and B = 0) as the plain build
    engine = strategy.prepare(model, total_steps=10)
    ids, mask = _ids(), torch.ones(2, 11, dtype=torch.long)
    score = torch.zeros(2, 10, dtype=torch.long)
    score[:, 3:] = 1
    for _ in range(2):
        loss = -causal_lm_logprobs(engine, ids, mask, score, chunk_elements=3 * 1024).sum()
        engine.backward(loss)
        engine.step()
    after = dict(zip(names, full_copies(list(engine.module.parameters()))))
    for n in names:
        assert torch.equal(after[n], before[n]) == (".lora_" not in n), n


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sft.model.lora.target_modules=[qproj]"], r"'sft.model.lora.target_modules' \['qproj'\]: Target modules"),
        (["sft.model.lora.target_modules=[embed_tokens]"], r"'sft.model.lora.target_modules' matches model.embed_to"),
        (["sft.model.lora.modules_to_save=[embed]"], r"'sft.model.lora.modules_to_save' \['embed'\]: no module"),
        (
            ["sft.model.lora.load_in_4bit=true", "sft.strategy.zero_stage=3"],
            r"'sft.model.lora.load_in_4bit' keeps 4-bit base weights, which ZeRO-3 cannot partition: set "
            r"'sft.strategy.zero_stage' to 2 or lower",
        ),
    ],
)
def test_bad_targets_are_refused_naming_the_key_before_any_worker_starts(overrides, message, tmp_path):
    """The stage's set-up (on the driver, before any group starts) tries the adapters on the model's skeleton."""
    from rlhf_core.config import ConfigError, load_config
    from rlhf_core.jobs import stage_setup
    from tests.conftest import TINY

    cfg = load_config(TINY, [f"run_uri={tmp_path}", "sft.model.lora.rank=4", *overrides])
    with pytest.raises(ConfigError, match=message):
        stage_setup.setup_stage(cfg, "sft")


QLORA = LoraConfig(rank=4, alpha=8.0, load_in_4bit=True)


def _dequantised_twin(tok, model):
    """A plain fp32 model holding ``model``'s merged weights (dequant(W) + s B A): what the engines and the export
    get."""
    twin = _lm(tok, lora=None)
    twin.load_state_dict({t.name: t.value() for t in merged_tensors(model)})
    return twin


def test_qlora_trains_the_adapters_over_a_4bit_base_and_serves_its_dequantised_merge(tok, world, tmp_path):
    """nf4 on this CPU (bitsandbytes' CPU backend): the base weights are 4-bit and stay so bit for bit, the adapters
    train, and the model computes exactly dequant(W) + s B A: the merged weights the export holds."""
    import bitsandbytes as bnb

    model = _lm(tok, lora=QLORA)
    q_proj = model.model.layers[0].self_attn.q_proj.get_base_layer()
    assert isinstance(q_proj, bnb.nn.Linear4bit) and q_proj.weight.dtype == torch.uint8
    assert type(model.lm_head) is torch.nn.Linear  # the LM head stays whole
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    assert len(packed) == 14
    plain = _lm(tok, lora=None)
    with torch.no_grad():
        # nf4 rounds the base: the quantised model differs from the fp32 one, and equals its dequantised twin
        assert (model(_ids()).logits - plain(_ids()).logits).abs().max().item() > 1e-3
        assert (model(_ids()).logits - _dequantised_twin(tok, model)(_ids()).logits).abs().max().item() < 1e-5
    strategy, engine = _engine(model)
    for seed in (0, 1):
        _step(engine, seed)
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in packed.items())
    engine.module.eval()  # a forward in eval mode without autograd, as the roles' experience forwards
    with torch.no_grad():
        trained = engine.module(_ids(2)).logits
        assert (trained - _dequantised_twin(tok, engine.module)(_ids(2)).logits).abs().max().item() < 1e-5
    engine.module.train()
    _step(engine, 2)  # and training goes on after it, through the same exact kernel
    with torch.no_grad():
        trained = engine.module(_ids(2)).logits
    path = export_hf(engine.module, strategy.full_state_dict(engine), tok, tmp_path / "qlora")
    exported = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not getattr(exported.config, "quantization_config", None)
    with torch.no_grad():
        assert (exported(_ids(2)).logits - trained).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# lora.export: adapter. The stage's output is a PEFT adapter folder; every loader gets base + adapters merged.


def _adapter_record(lora, source="builtin:tiny"):
    from types import SimpleNamespace

    from rlhf_core.distributed.checkpoints import adapter_record

    ctx = SimpleNamespace(lora=lora, model_source=source, model_path="", init_seed=0, trust_remote_code=False)
    return adapter_record(ctx)


def _perturb(model, seed=3):
    """Move what trains (adapters, modules_to_save, a value head) away from its start, as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _values(hf_model):
    """A value model's per-token values through its backbone and ``score`` head (peft's wrapper of it included)."""
    backbone = getattr(hf_model, hf_model.base_model_prefix)
    return hf_model.score(backbone(input_ids=_ids(2)).last_hidden_state).squeeze(-1)


def test_a_saved_adapter_reloads_to_the_same_logits(tok, world, tmp_path):
    """An adapter export (peft's files, no model weights) loads through the project's loader
    (``node_files.local_model_path``: base + adapters merged) and through plain ``peft.PeftModel.from_pretrained`` to
    the trained model's logits; a value model keeps its head, QLoRA merges over the base quantised again."""
    from peft import PeftModel

    from rlhf_core.distributed.node_files import local_model_path

    lora = LoraConfig(rank=4, alpha=8.0, modules_to_save=["embed_tokens"], export="adapter")
    strategy, engine = _engine(_lm(tok, lora=lora))
    for seed in (0, 1):
        _step(engine, seed)
    with torch.no_grad():
        trained = engine.module(_ids(2)).logits
    path = export_hf(engine.module, strategy.full_state_dict(engine), tok, tmp_path / "adapter", _adapter_record(lora))
    files = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "adapter_base.json", "tokenizer.json"} <= files
    assert "config.json" not in files and "model.safetensors" not in files
    merged = local_model_path(str(path), cache=tmp_path / "cache")
    assert local_model_path(str(path), cache=tmp_path / "cache") == merged  # merged once per node
    with torch.no_grad():
        loaded = build_causal_lm(merged, tok, seed=1, dtype=torch.float32, attn="sdpa")(_ids(2)).logits
        assert (loaded - trained).abs().max().item() < 1e-5
        peft_model = PeftModel.from_pretrained(_lm(tok, lora=None), str(path)).eval()
        assert (peft_model(_ids(2)).logits - trained).abs().max().item() < 1e-5

    # a value model: the adapters on its backbone and the trained head (peft's modules_to_save: score)
    value_lora = LoraConfig(rank=4, alpha=8.0, export="adapter")
    rm = _perturb(build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa", lora=value_lora))
    wrapped = ScalarHeadModel(rm)  # (as the stages export it)
    rm_path = export_hf(wrapped, wrapped.state_dict(), tok, tmp_path / "rm", _adapter_record(value_lora))
    assert json.loads((rm_path / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
    merged_rm = local_model_path(str(rm_path), cache=tmp_path / "cache")
    other_head = build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    with torch.no_grad():
        other_head.score.weight.zero_()
        values = _values(rm)
        loaded = build_scalar_model(merged_rm, tok, seed=5, dtype=torch.float32, attn="sdpa")
        assert (_values(loaded) - values).abs().max().item() < 1e-5
        assert (_values(other_head) - values).abs().max().item() > 1e-3  # (the head is the trained one)
        peft_rm = PeftModel.from_pretrained(other_head, str(rm_path)).eval()
        assert (_values(peft_rm.base_model.model) - values).abs().max().item() < 1e-5

    # QLoRA: the merge is dequant(quant(W)) + s B A, the 4-bit model exactly
    qlora = LoraConfig(rank=4, alpha=8.0, load_in_4bit=True, export="adapter")
    quantised = _perturb(_lm(tok, lora=qlora)).eval()
    q_path = export_hf(quantised, quantised.state_dict(), tok, tmp_path / "qlora", _adapter_record(qlora))
    merged_q = local_model_path(str(q_path), cache=tmp_path / "cache")
    with torch.no_grad():
        loaded = build_causal_lm(merged_q, tok, seed=1, dtype=torch.float32, attn="sdpa")(_ids(2)).logits
        assert (loaded - quantised(_ids(2)).logits).abs().max().item() < 1e-5


def test_a_stage_base_is_recorded_by_content_and_found_in_the_store_or_beside_the_folder(tok, tmp_path):
    """An adapter trained over ``stage:sft`` loads from the store (a ``StageModel``, as the workers get it) and from
    the run folder on disk; a base replaced since is refused."""
    from rlhf_core.distributed.node_files import local_model_path, stage_model
    from rlhf_core.models.builders import ModelPathError
    from rlhf_core.storage import ArtifactError, ObjectStore

    store = ObjectStore(str(tmp_path / "run"))
    base_dir = tmp_path / "base"
    _lm(tok, lora=None, seed=7).save_pretrained(str(base_dir))
    tok.save_pretrained(str(base_dir))
    store.put_artifact(str(base_dir), "sft", stage="sft", config_hash="h0")
    lora = LoraConfig(rank=4, alpha=8.0, export="adapter")
    model = _perturb(build_causal_lm(str(base_dir), tok, seed=0, dtype=torch.float32, attn="sdpa", lora=lora))
    record = _adapter_record(lora, source=stage_model(store, "sft"))
    assert record.base == "stage:sft" and record.base_content == stage_model(store, "sft").content_hash
    export_hf(model, model.state_dict(), tok, tmp_path / "export", record)
    store.put_artifact(str(tmp_path / "export"), "dpo", stage="dpo", config_hash="h1")
    with torch.no_grad():
        trained = model(_ids(2)).logits
        for source in (stage_model(store, "dpo"), str(tmp_path / "run" / "dpo")):
            path = local_model_path(source, cache=tmp_path / "cache")
            loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            assert (loaded(_ids(2)).logits - trained).abs().max().item() < 1e-5, source
    _lm(tok, lora=None, seed=8).save_pretrained(str(base_dir))  # sft reran: another base
    store.put_artifact(str(base_dir), "sft", stage="sft", config_hash="h2")
    with pytest.raises(ArtifactError, match=r"adapters trained over another stage:sft output .*: rerun dpo"):
        local_model_path(stage_model(store, "dpo"), cache=tmp_path / "cache2")
    with pytest.raises(ModelPathError, match=r"is not the stage:sft output these adapters were trained over"):
        local_model_path(str(tmp_path / "run" / "dpo"), cache=tmp_path / "cache2")


def test_a_stage_reference_to_an_adapter_export_loads_the_trained_model(tmp_path):
    """A short SFT job (in this process) with ``lora.export=adapter``: its output is the adapter folder, and the
    reward model's ``stage:sft`` resolves to base + adapters merged, the model peft loads over the base."""
    from peft import PeftModel

    from rlhf_core.config import load_config
    from rlhf_core.distributed.cluster import LocalCluster
    from rlhf_core.jobs import process, sft, stage_setup
    from tests.conftest import TINY

    overrides = ["sft.model.lora.rank=4", "sft.model.lora.export=adapter", "sft.data.max_samples=32"]
    cfg = load_config(TINY, [f"run_uri={tmp_path / 'run'}", *overrides])
    sft.run(cfg, "sft", cluster=LocalCluster())
    out = tmp_path / "run" / "sft"
    assert (out / "adapter_model.safetensors").is_file() and not (out / "config.json").exists()
    st = stage_setup.setup_stage(cfg, "reward_model")
    tok = load_tokenizer(st.model_path)
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(st.model_path, dtype=torch.float32)(_ids(2)).logits
        peft_model = PeftModel.from_pretrained(_lm(tok, lora=None), str(out)).eval()
        assert (loaded - peft_model(_ids(2)).logits).abs().max().item() < 1e-5
    assert (loaded - _lm(tok, lora=None)(_ids(2)).logits).abs().max().item() > 1e-4  # the adapters trained
    process.remove_scratch()
