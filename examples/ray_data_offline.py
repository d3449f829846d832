# What this shows: offline generation over a Ray Data dataset with acb, data parallel: a pool of
# actors, one acb engine each (one per GPU on a GPU cluster), fed batches of rows by Ray Data;
# the output rows (the input columns plus generated_text, generated_token_ids, ...) stream back
# to this script as they are made, or to Parquet files with --out.
#
# Run it here (a local Ray on this machine, acb's embedded random-weight model, whose text is
# meaningless):
#     python examples/ray_data_offline.py
# On a real checkpoint and a GPU cluster (`ray start --head` on one node, `ray start
# --address=HEAD:6379` on the others; the checkpoint on storage every node reads), from the head:
#     python examples/ray_data_offline.py --model /shared/my-model --address auto \
#         --concurrency 8 --num-prompts 100000 --max-new-tokens 256 --out /shared/generations
# (--concurrency: how many engines; each takes one GPU by default when the cluster has GPUs.)
"""Offline generation over a Ray Data dataset, one acb engine per actor."""

from __future__ import annotations

import argparse
import time
from typing import Any

import ray

from acb.distributed.ray import generate_dataset


def embedded_model() -> tuple[Any, Any]:
    """acb's embedded default model and its byte tokenizer; runs in each actor (Ray pickles this
    function, defined in the script, by value)."""
    from acb.models import build_tokenizer, default_model

    return default_model(), build_tokenizer()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="a checkpoint every node can read (default: the embedded model)")
    p.add_argument("--address", default=None, help='a running Ray cluster ("auto"); default: start a local one')
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=2, help="actors, i.e. engines")
    p.add_argument("--batch-size", type=int, default=16, help="rows handed to an engine at once")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write the rows as Parquet files here instead of reading them back")
    args = p.parse_args()

    ray.init(address=args.address, num_cpus=args.num_cpus if args.address is None else None)
    ds = ray.data.from_items(
        [{"id": i, "prompt": f"Prompt {i}: say something about the number {i}."} for i in range(args.num_prompts)]
    )
    out = generate_dataset(
        ds,
        model=args.model,
        model_factory=None if args.model else embedded_model,
        # the embedded model is small: a small KV cache is plenty; a checkpoint sizes it from memory
        config=None if args.model else {"page_size": 16, "num_blocks": 512},
        sampling={"max_new_tokens": args.max_new_tokens},
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        worker_column="worker",
    )
    t0 = time.perf_counter()
    if args.out:
        out.write_parquet(args.out)
        print(f"{args.num_prompts} rows written to {args.out} in {time.perf_counter() - t0:.1f} s")
        return
    rows, tokens, workers = [], 0, set()
    for row in out.iter_rows():  # rows arrive as the actors finish their batches, in no set order
        tokens += row["num_generated_tokens"]
        workers.add(row["worker"])
        rows.append((row["id"], row["prompt"], row["generated_text"]))
    wall = time.perf_counter() - t0
    print(
        f"{len(rows)} rows from {len(workers)} actors: {tokens} tokens in {wall:.1f} s "
        f"({tokens / wall:.0f} tokens/s, actor start-up included)"
    )
    for i, prompt, text in sorted(rows)[:3]:
        print(f"[{i}] {prompt!r} -> {text!r}")


if __name__ == "__main__":
    main()
