"""LoRA adapters made with PEFT on the tiny test models, and transformers + PEFT as the oracle (tests/worker/test_lora.py,
the cluster and front tests)."""

from __future__ import annotations

import torch
from hf_reference import hf_model

from infer import LoRARequest

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> PEFT LoraConfig options (init_lora_weights=False: B random too, so each adapter changes the output)
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-rs": dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS, use_rslora=True),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


def make_adapter(model_dir, folder, seed: int, **options) -> None:
    """A PEFT LoRA adapter of `model_dir` with random A and B, saved in `folder`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(model_dir), LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))


def peft_greedy(model_dir, adapter_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers (+ PEFT's adapter when given): `max_new` greedy tokens per prompt (EOS ignored), one prompt at
    a time."""
    from peft import PeftModel

    model = hf_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def make_adapters(model_dir, tmp_path_factory, names=tuple(ADAPTERS)) -> dict:
    """{name: folder} of ADAPTERS' adapters of `model_dir`, each seeded by its place in ADAPTERS."""
    folders = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        if name in names:
            folders[name] = tmp_path_factory.mktemp(f"lora-{name}")
            make_adapter(model_dir, folders[name], 100 + i, **options)
    return folders


async def load_unload_cycles(client, name: str, folder, cycles: int, rss) -> list[int]:
    """`cycles` loads and unloads of adapter `folder` as `name` through an admin InferenceClient, no request
    between them; `rss()` (a worker's resident bytes) read after each unload: the samples, in order."""
    samples = []
    for _ in range(cycles):
        await client.add_lora(LoRARequest(name, 1, folder))
        await client.remove_lora(name)
        samples.append(rss())
    return samples
