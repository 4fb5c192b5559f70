"""The newer families through `infer-serve` and the HTTP front with the official openai client: a tiny random checkpoint
of each (Gemma 2, Gemma 3, Phi-3, DeepSeek-V2, GPT-OSS) saved with a chat template in its family's turn format, served
by one worker; a chat completion renders the template and returns transformers' greedy continuation of the rendered
prompt (its text and token counts)."""

from __future__ import annotations

import copy
from pathlib import Path

import openai
import pytest
from family_models import DEEPSEEK_V2, GEMMA2, PHI3, tiny_checkpoint
from gemma_models import tiny_gemma3
from gpt_oss_models import tiny_gpt_oss
from hf_reference import transformers_greedy
from serve_harness import Served

MAX_NEW = 6
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
FLAGS = [
    "--workers",
    "1",
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "8000000",
    "--threads",
    "1",
]

# Each family's turn format (the shape of its released template; no hub here, so written out).
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEMPLATES = {
    "gemma2": GEMMA_TEMPLATE,
    "gemma3": GEMMA_TEMPLATE,
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "deepseek_v2": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
        "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\n"
        "{% else %}Assistant: {{ m['content'] }}\n\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
    "gpt_oss": (
        "{% for m in messages %}<|start|>{{ 'developer' if m['role'] == 'system' else m['role'] }}"
        "<|message|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    ),
}


def _checkpoint(name: str, path: Path, tokenizer) -> Path:
    if name == "gemma3":
        return tiny_gemma3(path, tokenizer)
    if name == "gpt_oss":
        return tiny_gpt_oss(path, tokenizer)
    fields = {"gemma2": GEMMA2, "phi3": PHI3, "deepseek_v2": DEEPSEEK_V2}[name]
    return tiny_checkpoint(path, tokenizer, name, **fields)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chat_completion_through_infer_serve_equals_transformers(name, smollm2_tokenizer, tmp_path):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = TEMPLATES[name]
    path = _checkpoint(name, tmp_path / name, tokenizer)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    want = transformers_greedy(path, [prompt], MAX_NEW)[0]
    served = Served(path, tmp_path / "serve.log", name, FLAGS)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(
            model=name, messages=MESSAGES, temperature=0, max_tokens=MAX_NEW, extra_body={"ignore_eos": True}
        )
    finally:
        served.stop()
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == MAX_NEW
    assert chat.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
