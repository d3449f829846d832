"""Run lm-evaluation-harness on a model through acb: lm-eval's model "acb".

Writes two tiny local tasks (a multiple-choice one scored by loglikelihood, a generation one
scored by exact match, both from JSONL files), evaluates them with `lm_eval.simple_evaluate`
and prints the metrics. Without --pretrained it runs acb's embedded random-weight model, so the
scores are chance level; on a real checkpoint (needs `pip install -e ".[eval]"` in acb's checkout):

    python examples/lm_eval_acb.py --pretrained Qwen/Qwen2.5-0.5B --device cuda

lm-eval's own tasks run the same way from its command line, with "acb" registered first:

    python -m acb.integrations.lm_eval --model acb --model_args pretrained=PATH --tasks hellaswag --device cuda
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile

import lm_eval
from lm_eval.tasks import TaskManager

from acb.models import build_tokenizer, default_model

importlib.import_module("acb.integrations.lm_eval")  # registers the model "acb" with lm-eval

MC = [
    ("2 + 3 =", [" 5", " 6", " 4", " 7"], 0),
    ("The capital of France is", [" Rome", " Paris", " Berlin"], 1),
    ("Water freezes at", [" 100 degrees", " 0 degrees"], 1),
    ("The opposite of hot is", [" cold", " warm"], 0),
    ("A week has", [" 5 days", " 7 days", " 10 days"], 1),
    ("The sky on a clear day is", [" green", " blue"], 1),
]
GEN = [
    ("Q: What is 2 + 2?\nA:", "4"),
    ("Q: What color is grass?\nA:", "green"),
    ("Q: How many legs has a cat?\nA:", "4"),
]

TASKS = {
    "acb_example_mc": (
        "mc",
        r"""output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
target_delimiter: ""
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""",
    ),
    # greedy answers, cut at the first newline or full stop, compared without case or whitespace
    "acb_example_gen": (
        "gen",
        r"""output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\n", "."]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: ['\s']
""",
    ),
}


def write_tasks(folder: str) -> None:
    """The two tasks as lm-eval YAML over local JSONL files (dataset_path: json)."""
    rows = {
        "mc": [{"question": q, "choices": c, "label": y} for q, c, y in MC],
        "gen": [{"question": q, "answer": a} for q, a in GEN],
    }
    for name, (data, body) in TASKS.items():
        path = os.path.join(folder, f"{data}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[data])
        header = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
        )
        with open(os.path.join(folder, f"{name}.yaml"), "w", encoding="utf-8") as f:
            f.write(header + body)


def main(pretrained: str | None, device: str, dtype: str) -> dict[str, dict[str, float]]:
    folder = tempfile.mkdtemp()
    if pretrained is None:  # the embedded model, saved like any checkpoint
        pretrained = os.path.join(folder, "model")
        default_model().save_pretrained(pretrained)
        build_tokenizer().save_pretrained(pretrained)
    write_tasks(folder)
    # only this folder's tasks: indexing lm-eval's built-in ones takes seconds
    tasks = TaskManager(include_path=folder, include_defaults=False)
    results = lm_eval.simple_evaluate(
        model="acb",
        model_args=f"pretrained={pretrained},dtype={dtype}",
        tasks=list(TASKS),
        task_manager=tasks,
        device=device,
    )
    assert results is not None  # None only on the non-zero ranks of a distributed run
    scores = {
        task: {k.split(",")[0]: v for k, v in res.items() if "," in k and "_stderr" not in k}
        for task, res in results["results"].items()
    }
    print(f"{'task':<18}{'metric':<14}value")
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            print(f"{task:<18}{metric:<14}{value:.4f}")
    return scores


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", default=None, help="a checkpoint directory or hub id (default: the embedded model)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    args = p.parse_args()
    main(args.pretrained, args.device, args.dtype)
