"""lm-eval model "acb-multimodal" against lm-eval's own "hf-multimodal" backend on tiny random VLMs.

Two local tasks whose documents carry images (``doc_to_image``: a Python function that draws each
document's images from its seeds; no downloads) run through ``lm_eval.simple_evaluate``:

- a ``generate_until`` task, with both backends (hf-multimodal batching 4 documents, padded):
  every logged generation and the metric must be equal; LLaVA by checkpoint path, Idefics3 as a
  model object with its processor object, and LLaVA again under the chat template;
- a multiple-choice (``loglikelihood``) task, which hf-multimodal refuses (``NotImplementedError``:
  "not yet tested" in lm-eval): acb's numbers are checked against hf-multimodal's own pair
  encoding (``_encode_multimodal_pair``) and image batching (``_batch_images``) run through the
  model's forward, the computation its unreachable ``_multimodal_loglikelihood_tokens`` does.

Documents with the same text and different images give different outputs, so an image that did
not reach the model (or reached the wrong request) fails the comparison.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.hf_vlms import HFMultimodalLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from acb.integrations.lm_eval import AcbMultimodalLM  # noqa: E402
from tests.vlm_models import image, tiny_vlm  # noqa: E402

ARCHS = ("llava", "idefics3")
GEN, MC = "acb_mm_gen", "acb_mm_mc"
MAX_GEN_TOKS = 8
NUM_BLOCKS = 20  # of 8 tokens: the longest request fits, not all of them at once
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# each document: its images' seeds (a seed below 0: a 40x56 image) and its question; documents 1
# and 2 (and 4 and 5) differ only by their images
DOCS = [
    {"seeds": [1], "q": "What is in the picture?"},
    {"seeds": [2], "q": "Describe it"},
    {"seeds": [3], "q": "Describe it"},
    {"seeds": [4, -5], "q": "Compare the two images"},
    {"seeds": [-6], "q": "Colour"},
    {"seeds": [7], "q": "Colour"},
]

# doc_to_image for the tasks (tests.vlm_models.image, restated: lm-eval loads it from the task's folder)
UTILS = """
import numpy as np
from PIL import Image


def image(seed, size=(64, 64)):
    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def doc_to_image(doc):
    return [image(s) if s >= 0 else image(-s, (40, 56)) for s in doc["seeds"]]
"""


def doc_images(doc: dict) -> list:
    return [image(s) if s >= 0 else image(-s, (40, 56)) for s in doc["seeds"]]


def doc_text(doc: dict) -> str:
    return "<image>" * len(doc["seeds"]) + doc["q"] + ":"


def _processed(arch: str, text: str, images: list):
    _, processor = tiny_vlm(arch)
    return processor(text=[text], images=images if arch == "llava" else [images], return_tensors="pt")


def _greedy(arch: str, text: str, images: list, n: int) -> list[int]:
    model, _ = tiny_vlm(arch)
    inputs = _processed(arch, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _printable(tok, ids: list[int]) -> str:
    """The longest prefix of ``ids`` that decodes to printable ASCII (it encodes back to the same ids)."""
    text = ""
    for t in ids:
        piece = tok.decode([t])
        if not (piece.isascii() and piece.isprintable()):
            break
        text += piece
    return text


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The two checkpoints (model and processor saved) and the two tasks.

    Built from the models' own greedy outputs so that the checks bite: the stop strings are
    characters the models do generate (one generation target is LLaVA's text cut at them), and
    some choices are the greedy continuation of their context.
    """
    d = tmp_path_factory.mktemp("lm_eval_mm")
    for arch in ARCHS:
        model, processor = tiny_vlm(arch)
        model.save_pretrained(d / arch)
        processor.save_pretrained(d / arch)
    tok = tiny_vlm("llava")[1].tokenizer

    refs = {
        arch: [tok.decode(_greedy(arch, doc_text(doc), doc_images(doc), MAX_GEN_TOKS)) for doc in DOCS[:2]]
        for arch in ARCHS
    }
    until = sorted(
        {
            next(c for c in ref[1:] if c.isascii() and c.isprintable() and not c.isspace())
            for rs in refs.values()
            for ref in rs[:1]
        }
    )
    target = min((refs["llava"][0].split(s)[0] for s in until), key=len)
    gen = [{**doc, "t": target if i == 0 else "no such output"} for i, doc in enumerate(DOCS)]

    mc = []
    for i, doc in enumerate(DOCS):
        greedy = _printable(tok, _greedy("llava", doc_text(doc), doc_images(doc), 3))
        choices = [c for c in (greedy, " yes", " no", " a cat") if c]
        mc.append({**doc, "choices": choices, "gold": i % len(choices)})

    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(UTILS)
    for name, rows in (("gen", gen), ("mc", mc)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = (
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'doc_to_text: "{{% for s in seeds %}}<image>{{% endfor %}}{{{{q}}}}:"\n'
        "doc_to_image: !function utils.doc_to_image\n"
    )
    (tasks / "gen.yaml").write_text(
        f"task: {GEN}\n" + head.format(data=d / "gen.jsonl") + 'output_type: generate_until\ndoc_to_target: "{{t}}"\n'
        f"generation_kwargs:\n  until: {json.dumps(until)}\n  max_gen_toks: {MAX_GEN_TOKS}\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    (tasks / "mc.yaml").write_text(
        f"task: {MC}\n"
        + head.format(data=d / "mc.jsonl")
        + 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
    )
    return {"dir": d, "tasks": tasks, "mc": mc}


@pytest.fixture(scope="module")
def task_manager(workdir):
    return TaskManager(include_path=str(workdir["tasks"]), include_defaults=False)


def _evaluate(model, model_args, task_manager, tasks, **kwargs):
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager,
        device="cpu",
        log_samples=True,
        **kwargs,
    )


def _samples(results: dict, task: str) -> list[dict]:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(DOCS)))
    return samples


def _assert_same_generations(hf: dict, got: dict) -> None:
    for s, t in zip(_samples(hf, GEN), _samples(got, GEN)):
        assert s["resps"] == t["resps"], f"doc {s['doc_id']}"
        assert s["filtered_resps"] == t["filtered_resps"], f"doc {s['doc_id']}"
    assert hf["results"][GEN] == got["results"][GEN]


@pytest.fixture(scope="module")
def hf_gen(workdir, task_manager):
    return {
        arch: _evaluate("hf-multimodal", f"pretrained={workdir['dir'] / arch}", task_manager, [GEN], batch_size=4)
        for arch in ARCHS
    }


def test_the_generation_task_exercises_what_it_should(hf_gen):
    """A stop string cut a generation (the target matched), and the images change the text."""
    outs = {arch: [s["resps"][0][0] for s in _samples(hf_gen[arch], GEN)] for arch in ARCHS}
    assert hf_gen["llava"]["results"][GEN]["exact_match,none"] > 0
    for texts in outs.values():
        assert texts[1] != texts[2] and texts[4] != texts[5]  # same text, other images


def test_generate_until_by_path_matches_hf_multimodal(workdir, task_manager, hf_gen):
    got = _evaluate("acb-multimodal", f"pretrained={workdir['dir'] / 'llava'}", task_manager, [GEN])
    _assert_same_generations(hf_gen["llava"], got)


def test_generate_until_model_object_matches_hf_multimodal(task_manager, hf_gen):
    """A model object and its processor object (Idefics3: tiles, a pixel mask, images as one list
    per text), with a KV cache small enough that requests are preempted."""
    model, processor = tiny_vlm("idefics3")
    with AcbMultimodalLM(model, processor=processor, page_size=8, num_blocks=NUM_BLOCKS, max_batch_tokens=16) as lm:
        got = _evaluate(lm, None, task_manager, [GEN])
        assert lm.engine.stats.preemptions > 0
    _assert_same_generations(hf_gen["idefics3"], got)


def test_chat_template_matches_hf_multimodal(workdir, task_manager):
    """Under the processor's chat template (the images placed by it, not by replacing ``<image>``)."""
    path = workdir["dir"] / "llava"
    kw = {"apply_chat_template": True}
    hf = _evaluate("hf-multimodal", f"pretrained={path}", task_manager, [GEN], batch_size=4, **kw)
    got = _evaluate("acb-multimodal", f"pretrained={path}", task_manager, [GEN], **kw)
    assert _samples(got, GEN)[0]["arguments"][0][0].startswith("user: <image>")  # the template's rendering
    _assert_same_generations(hf, got)


@pytest.fixture(scope="module")
def hf_llava(workdir):
    return HFMultimodalLM(pretrained=str(workdir["dir"] / "llava"), device="cpu")


def _hf_loglikelihood(hf: HFMultimodalLM, context: str, continuation: str, images: list) -> tuple[float, bool]:
    """What hf-multimodal's ``_multimodal_loglikelihood_tokens`` computes for one pair (that code is
    unreachable: its ``loglikelihood`` raises first): its own pair encoding and image batching, the
    model's forward on context + continuation but the last token, the continuation's log-softmax."""
    ctx, cont, image_enc = hf._encode_multimodal_pair(context, continuation, images)
    inp = torch.tensor([(ctx + cont)[-(hf.max_length + 1) :][:-1]])
    logits = torch.log_softmax(hf._model_multimodal_call(inp, hf._batch_images([image_enc])), dim=-1)
    logits = logits[0, inp.shape[1] - len(cont) :]
    want = torch.tensor(cont)
    return float(logits.gather(1, want[:, None]).sum()), bool((logits.argmax(-1) == want).all())


def test_loglikelihood_matches_hf_multimodal_scoring(workdir, task_manager, hf_llava):
    docs = workdir["mc"]
    with pytest.raises(NotImplementedError):  # when lm-eval enables it, compare through simple_evaluate instead
        hf_llava.loglikelihood([Instance("loglikelihood", docs[0], ("<image>x:", " yes", {"visual": [image(1)]}), 0)])
    got = _evaluate("acb-multimodal", f"pretrained={workdir['dir'] / 'llava'}", task_manager, [MC])
    flags, correct = [], 0
    for s, doc in zip(_samples(got, MC), docs):
        want = [_hf_loglikelihood(hf_llava, doc_text(doc), c, doc_images(doc)) for c in doc["choices"]]
        have = [tuple(r[0]) for r in s["resps"]]
        assert len(have) == len(want)
        for (lp, greedy), (lp2, greedy2) in zip(want, have):
            assert lp2 == pytest.approx(lp, abs=1e-4) and greedy2 == greedy, f"doc {s['doc_id']}: {want} vs {have}"
        flags += [g for _, g in want]
        correct += max(range(len(want)), key=lambda i: want[i][0]) == doc["gold"]
    assert any(flags) and not all(flags)
    assert got["results"][MC]["acc,none"] == pytest.approx(correct / len(docs))
    # documents with the same question and other images score differently
    lps = [s["resps"][0][0][0] for s in _samples(got, MC)]
    assert not math.isclose(lps[4], lps[5], abs_tol=1e-3)


def test_text_requests_images_refused_and_cut(workdir, hf_llava):
    """Requests without images go the text path (as hf-multimodal's), mixed with image requests in
    one call; what hf-multimodal refuses is refused; a context cut from the left keeps its image."""
    with AcbMultimodalLM(str(workdir["dir"] / "llava"), device="cpu", max_length=48) as lm:
        text = Instance("loglikelihood", {}, ("Colour:", " red"), 0)
        img = Instance("loglikelihood", {}, ("<image>Colour:", " red", {"visual": [image(3)]}), 0)
        both = lm.loglikelihood([text, img, text])
        assert both[0] == both[2] == pytest.approx(hf_llava.loglikelihood([text])[0], abs=1e-4)
        assert both[1][0] == pytest.approx(
            _hf_loglikelihood(hf_llava, "<image>Colour:", " red", [image(3)])[0], abs=1e-4
        )
        with pytest.raises(NotImplementedError):
            lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("abc", {"visual": [image(1)]}), 0)])
        with pytest.raises(ValueError, match="non-empty context"):
            lm.loglikelihood([Instance("loglikelihood", {}, ("", " red", {"visual": [image(1)]}), 0)])
        # 48 - 8 = 40 context tokens: a long text before the image is cut, one after it cannot be
        gen = {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS}
        long_first = Instance("generate_until", {}, ("x" * 30 + "<image>ok", gen, {"visual": [image(1)]}), 0)
        assert len(lm.generate_until([long_first])) == 1
        long_last = Instance("generate_until", {}, ("<image>" + "x" * 30, gen, {"visual": [image(1)]}), 0)
        with pytest.raises(ValueError, match="cut an image"):
            lm.generate_until([long_last])
