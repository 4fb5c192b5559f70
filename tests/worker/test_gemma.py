"""What only Gemma has, on the tiny random checkpoints of tests/family_cases.py (their greedy tokens, logprobs, step
graphs and bf16 against transformers: tests/worker/test_families.py). Gemma 3 (text): each layer's window and rope
(local layers with a window of 8 and their own rope, a global one with linear scaling); Gemma 2: soft-capped windowed
layers and a query pre-attention scalar. What the layers do not compute is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from infer.worker.loading.loader import load_model


def test_gemma3_is_ours_with_each_layer_s_window_and_rope(family_dir):
    model = load_model(family_dir("gemma3"), torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.lm_head_tied
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8, 0, 8]
    ropes = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert ropes[0] is ropes[1] is ropes[3] is model.model.rotary_local
    assert ropes[2] is model.model.rotary_global
    assert not torch.equal(model.model.rotary_local.inv_freq, model.model.rotary_global.inv_freq)


def test_gemma2_is_ours_with_soft_capped_windowed_layers(family_dir):
    model = load_model(family_dir("gemma2"), torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Gemma2ForCausalLM" and model.lm_head_tied
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.window for a in attns] == [8, 0, 8, 0]
    assert all(a.softcap == 5.0 and a.scale == 24**-0.5 and a.q_norm is None for a in attns)
    assert model.final_logit_softcapping == 3.0


@pytest.mark.parametrize(
    "change, refused",
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "relu"),
    ],
)
def test_what_gemma3_does_not_compute_is_refused_by_name(family_dir, tmp_path, change, refused):
    gemma3 = family_dir("gemma3")
    for item in gemma3.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    config = json.loads((gemma3 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises((NotImplementedError, ValueError), match=refused):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
