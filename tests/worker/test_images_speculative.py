"""Vision models with speculative decoding (n-gram drafts): the image's prefill runs as without speculation, the
decode steps after it verify drafts (of these requests only: the drafts counted are theirs), and the greedy tokens
(with their logprobs) of prompts with images equal decoding without speculation, for LLaVA, LLaVA-NeXT, Qwen2-VL
(M-RoPE: a verification's rows take the request's position delta), Gemma 3 and Idefics3 (each family's own tests hold
those tokens to transformers'). A draft model, which reads text only, refuses images by name."""

from __future__ import annotations

import pytest
from gemma3_vision_models import BOI, gemma3_vision_checkpoint
from idefics3_models import idefics3_checkpoint
from llava_models import IMAGE_TOKEN, llava_checkpoint, png
from llava_next_models import llava_next_checkpoint
from qwen2_vl_models import IMAGE as QWEN_IMAGE
from qwen2_vl_models import qwen2_vl_checkpoint

from infer import LLM, SamplingParams

OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
# A text that repeats itself, so that n-gram drafts are found (some accepted, some not, on a random model).
REPEATS = " one two three one two three one two"
FAMILIES = {
    "llava": (llava_checkpoint, f"USER: {IMAGE_TOKEN}\n{REPEATS} ASSISTANT:"),
    "llava_next": (llava_next_checkpoint, f"USER: {IMAGE_TOKEN}\n{REPEATS} ASSISTANT:"),
    "qwen2_vl": (qwen2_vl_checkpoint, f"User: {QWEN_IMAGE}\n{REPEATS} Assistant:"),
    "gemma3": (gemma3_vision_checkpoint, f"{REPEATS}{BOI}{REPEATS}"),
    "idefics3": (idefics3_checkpoint, f"User:{IMAGE_TOKEN}\n{REPEATS} Assistant:"),
}


def _run(llm: LLM, prompts: list) -> list[list[tuple[int, float]]]:
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [c.error for c in out] == [None] * len(prompts)
    return [[(t, lp[t]) for t, lp in zip(c.token_ids, c.logprobs, strict=True)] for c in out]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ngram_speculation_with_images_gives_the_tokens_of_decoding_without_it(family, tmp_path, smollm2_tokenizer):
    build, prompt = FAMILIES[family]
    path = str(build(tmp_path / family, smollm2_tokenizer))
    prompts = [
        {"prompt": prompt, "multi_modal_data": {"image": png(48, 36, seed=21)}},
        {"prompt": prompt, "multi_modal_data": {"image": png(30, 40, seed=4)}},
    ]
    with LLM(model=path, **OPTIONS) as llm:
        want = _run(llm, prompts)
    with LLM(model=path, speculative_config=NGRAM, **OPTIONS) as llm:
        got = _run(llm, prompts)
        stats = llm.engine.stats
    for mine, theirs in zip(got, want, strict=True):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in theirs], abs=1e-4)
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0


def test_a_draft_model_refuses_images_by_name(tmp_path, smollm2_tokenizer):
    from family_models import tiny_checkpoint
    from transformers import AutoTokenizer

    path = str(llava_checkpoint(tmp_path / "llava", smollm2_tokenizer))
    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    draft = tiny_checkpoint(tmp_path / "draft", AutoTokenizer.from_pretrained(path), "llama", **shape)  # its vocabulary
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with LLM(model=path, speculative_config=spec, **OPTIONS) as llm:
        image = {"prompt": FAMILIES["llava"][1], "multi_modal_data": {"image": png(9, 9, 1)}}
        refused, text = llm.generate([image, REPEATS], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert refused.finish_reason == "error" and "images with a draft model are not supported" in refused.error
    assert text.error is None and len(text.token_ids) == 4
