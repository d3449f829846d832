"""Evaluate a model over a JSONL dataset with `generate_batch`, and score it.

Each line holds a "question" and an "answer"; the model answers every question greedily (one
`generate_batch` call, with its progress bar) and the score is the share of answers the
generated text starts with (after whitespace). Results go to a JSONL file.

    python examples/eval_dataset.py --data qa.jsonl --model ./my-checkpoint --out answers.jsonl

Without --data it writes a five-line sample dataset; without --model it runs acb's embedded
random-weight model, whose answers are meaningless (the score is then about 0).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import acb
from acb.models import build_tokenizer, default_model

SAMPLE = [
    ("2 + 2 =", "4"),
    ("The capital of France is", "Paris"),
    ("H2O is", "water"),
    ("The opposite of hot is", "cold"),
    ("A week has this many days:", "7"),
]


def main(data: str | None, model_path: str | None, out_path: str, max_new_tokens: int) -> float:
    if data is None:
        data = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            for q, a in SAMPLE:
                f.write(json.dumps({"question": q, "answer": a}) + "\n")
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if model_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    else:
        model, tokenizer = default_model(), build_tokenizer()
    results = acb.generate_batch(
        model,
        [r["question"] for r in rows],
        tokenizer=tokenizer,
        sampling=acb.SamplingParams(max_new_tokens=max_new_tokens),
        continuous_batching_config=acb.ContinuousBatchingConfig(page_size=16, num_blocks=256),
    )
    correct = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for row, out in zip(rows, results.values()):
            ok = (out.text or "").strip().startswith(str(row["answer"]))
            correct += ok
            f.write(json.dumps({**row, "generated": out.text, "correct": ok}) + "\n")
    score = correct / len(rows) if rows else 0.0
    print(f"{correct}/{len(rows)} correct ({score:.1%}); answers in {out_path}")
    return score


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="JSONL with question/answer fields (default: a sample)")
    p.add_argument("--model", default=None, help="a local checkpoint directory")
    p.add_argument("--out", default="answers.jsonl", help="where the answers go")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()
    main(args.data, args.model, args.out, args.max_new_tokens)
