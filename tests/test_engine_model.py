"""What the rollout engines load: vLLM loads folders only, so a ``builtin:`` actor or policy is built with its
init_seed and saved first (``stage_setup.engine_model``), the same weights the training workers build."""

import torch
from safetensors.torch import load_file

from rlhf_core.jobs import stage_setup
from rlhf_core.models.builders import build_causal_lm, load_tokenizer


def test_a_builtin_model_is_saved_for_vllm_and_passed_as_it_is_to_hf(tmp_path):
    tok = load_tokenizer("builtin:tiny")
    st = stage_setup.StageSetup("ppo", None, None, str(tmp_path), {}, {}, "h", None, sources={"actor": "builtin:tiny"})
    assert stage_setup.engine_model(st, "actor", "hf", 3, tok) == "builtin:tiny"  # the HF engine builds it itself
    folder = stage_setup.engine_model(st, "actor", "vllm", 3, tok)
    saved = load_file(f"{folder}/model.safetensors")
    built = build_causal_lm("builtin:tiny", tok, seed=3, dtype=torch.float32, attn="sdpa").state_dict()
    assert saved.keys() <= built.keys() and all(torch.equal(saved[k], built[k]) for k in saved)
    assert load_tokenizer(folder).get_vocab() == tok.get_vocab()
    st.sources["actor"] = "/some/model/folder"
    assert stage_setup.engine_model(st, "actor", "vllm", 3, tok) == "/some/model/folder"
