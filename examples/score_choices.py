"""Score a multiple-choice dataset with `Engine.score_batch`: no sampling, one forward per context.

Each JSONL line holds a "question", its "choices" and the index of the right one ("answer").
Every question is put after the same few-shot preamble (as an MMLU-style evaluation does), and
the model's pick is the choice with the highest log-probability. The preamble is computed once
for the whole dataset (the prefix cache), and one-token choices of a question cost one forward
of its context; the script prints the accuracy and how many context tokens came from the cache.

    python examples/score_choices.py --data mcq.jsonl --model ./my-checkpoint

Without --data it writes a small sample; without --model it runs acb's embedded random-weight
model, whose picks are meaningless (accuracy about 1 / number of choices).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import acb
from acb.models import build_tokenizer, default_model

PREAMBLE = (
    "Answer with the letter of the right choice.\n\n"
    "Q: The colour of the sky on a clear day?\nA. green\nB. blue\nC. red\nAnswer: B\n\n"
    "Q: How many legs has a cat?\nA. four\nB. two\nC. six\nAnswer: A\n\n"
)
SAMPLE = [
    ("Water freezes at how many degrees Celsius?", ["100", "0", "50"], 1),
    ("Which is a fruit?", ["apple", "brick", "chair"], 0),
    ("The largest planet of the solar system?", ["Mars", "Venus", "Jupiter"], 2),
    ("Which animal barks?", ["dog", "fish", "snake"], 0),
]
LETTERS = "ABCDEFGH"


def main(data: str | None, model_path: str | None) -> float:
    if data is None:
        data = os.path.join(tempfile.mkdtemp(), "sample.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            for q, choices, answer in SAMPLE:
                f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if model_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    else:
        model, tokenizer = default_model(), build_tokenizer()
    items = []
    for row in rows:
        options = "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(row["choices"]))
        context = tokenizer(f"{PREAMBLE}Q: {row['question']}\n{options}Answer:")["input_ids"]
        letters = [
            tokenizer(f" {LETTERS[i]}", add_special_tokens=False)["input_ids"] for i in range(len(row["choices"]))
        ]
        items.append((context, letters))
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=256), tokenizer=tokenizer) as engine:
        outs = engine.score_batch(items)
    correct = 0
    for row, out in zip(rows, outs):
        pick = max(range(len(out.continuations)), key=lambda i: out.continuations[i].logprob)
        correct += pick == row["answer"]
    cached = sum(o.num_cached_tokens for o in outs)
    total = sum(len(ctx) for ctx, _ in items)
    score = correct / len(rows) if rows else 0.0
    print(f"{correct}/{len(rows)} correct ({score:.1%}); {cached} of {total} context tokens read from the prefix cache")
    return score


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="JSONL with question/choices/answer fields (default: a sample)")
    p.add_argument("--model", default=None, help="a local checkpoint (default: acb's embedded random-weight model)")
    args = p.parse_args()
    main(args.data, args.model)
