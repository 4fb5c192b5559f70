"""An RL loop around infer: generate -> score -> update the policy -> push the new weights -> generate.

The policy is a transformers model trained here (REINFORCE with a mean baseline); infer serves it from
memory (`LLM(model=<the transformers model>, tokenizer=...)`: no checkpoint on disk) and takes each new version
with `update_weights(policy.state_dict().items())`. The reward is a toy one (the share of sampled tokens in the
lower half of the vocabulary) so the run shows learning on a tiny random model in seconds.

    python examples/rl_loop.py --model DIR [--steps 8] [--coordinator]

With --coordinator, generation goes through a coordinator and an engine on a worker thread of this process (an
SPMD world of one rank: what every rank of a torchrun job would do), the new weights travel over a
torch.distributed (gloo) weight-sync group, and the engine is suspended (KV pool and weights released) while the
policy trains. The last line is a JSON summary (rewards per step, weight versions, whether the served weights
equal the trained ones).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer import LLM, SamplingParams


def reward(token_ids: list[int], vocab_size: int) -> float:
    """The toy reward: the share of tokens in the lower half of the vocabulary."""
    return sum(t < vocab_size // 2 for t in token_ids) / max(1, len(token_ids))


def reinforce_step(
    policy, optimizer, prompts: list[list[int]], samples: list[list[int]], rewards: list[float]
) -> float:
    """One policy-gradient step: raise the log-likelihood of samples that scored above the batch mean."""
    baseline = sum(rewards) / len(rewards)
    policy.train()
    optimizer.zero_grad()
    loss = torch.zeros(())
    for prompt, sample, r in zip(prompts, samples, rewards):
        ids = torch.tensor([prompt + sample])
        logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample)[:, None]).sum()
        loss = loss - (r - baseline) * logp / len(prompts)
    loss.backward()
    optimizer.step()
    policy.eval()
    return float(loss.detach())


def served_equals_trained(llm: LLM, policy, prompts: list[list[int]]) -> bool:
    """Greedy tokens of the served engine == transformers' generate on the trained policy."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    served = [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]
    with torch.inference_mode():
        expected = []
        for p in prompts:
            x = torch.tensor([p])
            y = policy.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=6,
                min_new_tokens=6,
                pad_token_id=0,
            )
            expected.append(y[0, len(p) :].tolist())
    return served == expected


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory (transformers layout) to start from")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--coordinator", action="store_true", help="serve through a coordinator (see above)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for training and for the engine")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    vocab = policy.config.vocab_size
    prompts = [[11 + i, 200 + 7 * i, 3] for i in range(args.batch)]
    llm = LLM(
        model=policy,
        tokenizer=tokenizer,
        use_coordinator=args.coordinator,
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=8 << 20,
        num_threads=args.threads,
    )
    rewards, versions, released = [], [], 0
    started = time.monotonic()
    try:
        for step in range(args.steps):
            params = [
                SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1000 * step + i)
                for i in range(len(prompts))
            ]
            completions = llm.generate(prompts, params, use_tqdm=False)  # generate
            scores = [reward(c.token_ids, vocab) for c in completions]  # score
            rewards.append(round(sum(scores) / len(scores), 4))
            if args.coordinator:  # free the serving memory while the policy trains
                llm.pause()
                llm.suspend()
                released = max(released, llm.stats().workers[0].load.bytes_released)
            reinforce_step(policy, optimizer, prompts, [c.token_ids for c in completions], scores)  # update
            if args.coordinator:
                llm.resume()
            versions.append(llm.update_weights(policy.state_dict().items()))  # push the weights
            if args.coordinator:
                llm.unpause()
            print(f"step {step}: mean reward {rewards[-1]:.3f} -> weights version {versions[-1]}", flush=True)
        summary = {
            "rewards": rewards,
            "versions": versions,
            "served_equals_trained": served_equals_trained(llm, policy, prompts[:3]),
            "bytes_released_while_training": released,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        llm.close()
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
