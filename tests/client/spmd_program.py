"""An SPMD program for torchrun (tests/client/test_spmd.py): every rank builds the same LLM; with a coordinator
rank 0 feeds the prompts and every rank's engine serves some, without one every rank serves its own.

    torchrun --nproc-per-node 2 spmd_program.py coordinator|direct MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

from infer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[7 + i, 100 + i, 5] for i in range(20)]


def main() -> None:
    mode, model, out = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    options = dict(dtype="float32", max_model_len=256, kv_cache_memory=4_000_000, num_threads=1, ready_timeout=120)
    result: dict = {}
    if mode == "coordinator":
        llm = LLM(model, use_coordinator=True, **options)
        result["primary"] = llm.is_primary_rank
        engine = llm.engine  # this rank's own engine (its worker thread serves with it)
        if llm.is_primary_rank:
            result["tokens"] = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            result["workers"] = len(llm.stats().workers)
        else:
            try:
                llm.generate(PROMPTS[0], GREEDY)
            except RuntimeError as e:
                result["refused"] = str(e)
        llm.close()  # rank 0: stops the cluster; the others: wait for that
        result["served_here"] = engine.stats.num_requests_finished
    else:
        llm = LLM(model, **options)
        result["primary"] = llm.is_primary_rank
        result["tokens"] = [c.token_ids for c in llm.generate([PROMPTS[rank]], GREEDY, use_tqdm=False)]
        llm.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
