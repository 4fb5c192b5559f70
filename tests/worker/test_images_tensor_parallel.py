"""Vision models under tensor parallelism (LLM's tensor_parallel_size in direct mode: rank 0 here, rank 1 a process
of its own): the language model sharded over the two ranks, the vision tower whole on each and run on rank 0 only,
whose features (and Qwen2-VL's M-RoPE positions, Gemma 3's image spans) rank 1 takes with each step
(worker/parallel/tp_commands.py). The greedy tokens of a prompt with an image, and of one with two, equal one process's, for
LLaVA, LLaVA-NeXT (each image's token count from its size), Qwen2-VL, Gemma 3 and Idefics3 (each image's tiles placed
as images of their own; each family's own tests hold one process's tokens to transformers')."""

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
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FAMILIES = {
    # family: (checkpoint builder, a prompt with one image, a prompt with two)
    "llava": (
        llava_checkpoint,
        f"USER: {IMAGE_TOKEN}\nWhat is it? ASSISTANT:",
        f"USER: {IMAGE_TOKEN} and {IMAGE_TOKEN}\nCompare. ASSISTANT:",
    ),
    "llava_next": (
        llava_next_checkpoint,
        f"USER: {IMAGE_TOKEN}\nWhat is it? ASSISTANT:",
        f"USER: {IMAGE_TOKEN} and {IMAGE_TOKEN}\nCompare. ASSISTANT:",
    ),
    "qwen2_vl": (
        qwen2_vl_checkpoint,
        f"User: {QWEN_IMAGE}\nWhat is it? Assistant:",
        f"User: {QWEN_IMAGE} and {QWEN_IMAGE}\nCompare. Assistant:",
    ),
    "gemma3": (gemma3_vision_checkpoint, f"What is it?{BOI}", f"Compare{BOI} and{BOI} now."),
    "idefics3": (idefics3_checkpoint, f"What is it?{IMAGE_TOKEN}", f"Compare{IMAGE_TOKEN} and{IMAGE_TOKEN} now."),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_2_gives_one_process_s_tokens(family, tmp_path, smollm2_tokenizer):
    build, one, two = FAMILIES[family]
    path = str(build(tmp_path / family, smollm2_tokenizer, vocab_multiple=64))
    prompts = [
        {"prompt": one, "multi_modal_data": {"image": png(48, 36, seed=21)}},
        {"prompt": two, "multi_modal_data": {"image": [png(30, 40, seed=4), png(56, 28, seed=9)]}},
    ]
    with LLM(model=path, **OPTIONS) as llm:
        want = [c.token_ids for c in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model=path, tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.engine.tp.size == 2
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [c.error for c in got] == [None, None]
        assert [c.token_ids for c in got] == want
        assert all(len(c.prompt_token_ids) > 16 for c in got)  # the images' tokens, expanded
