"""A conversation's second turn with the same image, against the same turn with cold caches: what the vision encoder's
cache and the prefix cache (blocks keyed by the image's content) save. A random-weight LLaVA-1.5 of a chosen size
(CLIP at 336 pixels in 14-pixel patches: 576 image tokens; `--vision-layers` / `--vision-hidden`, `--text-layers` /
`--text-hidden`), SmolLM2's tokenizer with an `<image>` token, float32, one engine in-process (greedy, ignore_eos).

For each of `--repeats` rounds on one engine: turn 1 (a new image, "USER: <image> ..."), then turn 2 (turn 1's prompt
and answer plus a new question, the same image) warm, then turn 2 again after the prefix cache and the encoder cache are
emptied (cold). Reported: time to first token (add_request -> first token, in-process) of turn 1, turn 2 warm and
turn 2 cold (medians), the cold / warm ratio, images encoded and prompt tokens served from the prefix cache in the
warm turn, and whether the warm and cold answers are the same tokens.

    .venv/bin/python benchmarks/images.py [--repeats 3] [--vision-layers 12] [--text-layers 8]
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_result

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def checkpoint(folder: Path, args: argparse.Namespace) -> Path:
    from transformers import AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from infer.worker.loading.model_files import resolve_model

    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(str(resolve_model(None))))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(
        hidden_size=args.vision_hidden,
        intermediate_size=4 * args.vision_hidden,
        num_hidden_layers=args.vision_layers,
        num_attention_heads=args.vision_hidden // 64,
        image_size=336,
        patch_size=14,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.text_hidden,
        intermediate_size=4 * args.text_hidden,
        num_hidden_layers=args.text_layers,
        num_attention_heads=args.text_hidden // 64,
        num_key_value_heads=args.text_hidden // 128,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>")
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def image(seed: int) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (480, 640, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def first_token(engine: Engine, rid: str, prompt: str, img: bytes) -> tuple[float, list[int]]:
    """(seconds from add_request to the first token, the answer's tokens)."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, PARAMS, images=[img])
    ttft, tokens = None, []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += delta.token_ids
    assert ttft is not None
    return ttft, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vision-layers", type=int, default=12)
    p.add_argument("--vision-hidden", type=int, default=768)
    p.add_argument("--text-layers", type=int, default=8)
    p.add_argument("--text-hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp), args)
        engine = Engine(
            EngineConfig(
                model=str(path),
                dtype="float32",
                max_model_len=2048,
                kv_cache_memory=1 << 30,
                num_threads=args.threads,
                max_num_batched_tokens=2048,
            )
        )
        encoder, blocks = engine.runner.images, engine.scheduler.block_manager
        assert encoder is not None
        turn1, warm, cold, encoded, hits, same = [], [], [], [], [], []
        for r in range(args.repeats):
            img = image(r)
            prompt = "USER: <image>\nWhat is in this picture? ASSISTANT:"
            t1, answer = first_token(engine, f"t1-{r}", prompt, img)
            second = prompt + engine.tokenizer.decode(answer) + " USER: And what colours? ASSISTANT:"
            before_encoded, before_hits = encoder.encoded, blocks.num_hit_tokens
            t2, warm_tokens = first_token(engine, f"t2-{r}", second, img)
            encoded.append(encoder.encoded - before_encoded)
            hits.append(blocks.num_hit_tokens - before_hits)
            blocks.reset_prefix_cache()
            encoder.clear()
            t2_cold, cold_tokens = first_token(engine, f"t2c-{r}", second, img)
            turn1.append(t1)
            warm.append(t2)
            cold.append(t2_cold)
            same.append(warm_tokens == cold_tokens)
            print(f"round {r}: turn 1 {t1 * 1e3:.0f} ms, turn 2 warm {t2 * 1e3:.0f} ms, cold {t2_cold * 1e3:.0f} ms")
    result = {
        "model": {k: v for k, v in vars(args).items() if k != "repeats"},
        "repeats": args.repeats,
        "turn1_ttft_ms": statistics.median(turn1) * 1e3,
        "turn2_warm_ttft_ms": statistics.median(warm) * 1e3,
        "turn2_cold_ttft_ms": statistics.median(cold) * 1e3,
        "cold_over_warm": statistics.median(cold) / statistics.median(warm),
        "warm_images_encoded": encoded,
        "warm_prefix_hit_tokens": hits,
        "warm_equals_cold": all(same),
    }
    print(f"{'':24}{'TTFT ms':>10}")
    for name in ("turn1_ttft_ms", "turn2_warm_ttft_ms", "turn2_cold_ttft_ms"):
        print(f"{name:24}{result[name]:10.0f}")
    print(f"cold / warm: {result['cold_over_warm']:.1f}x; warm turn encoded {encoded}, prefix hits {hits} tokens")
    print(write_result("images", result))
    sys.exit(0 if all(same) else 1)


if __name__ == "__main__":
    main()
