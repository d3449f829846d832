"""LoRA on a MoE's fused experts (issue 56): PEFT's ``target_parameters`` (a ``ParamWrapper`` per
3-D expert parameter, the delta folded into the weight before the experts run). A tiny Qwen3-MoE,
two random ``save_pretrained`` adapters (attention linears and both expert parameters; lora_B
randomised), and the base model in one mixed batch: each row's greedy tokens equal
``PeftModel.generate``'s with its adapter active, in every mode (plain, async batching, preemption
with offload), each row run through the experts once; an in-place ``update_lora`` by PEFT's keys,
expert tensors among them; the experts' bytes priced before the KV blocks."""

from __future__ import annotations

import copy
import functools
import weakref

import pytest
import torch

import acb
from acb.errors import WeightUpdateError
from acb.runner.kinds import LoraHooks
from tests.conftest import prompts_of_lengths
from tests.runner.test_lora import MAX_NEW, _generate, _qwen3_moe

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORAS = [None, "a", "b", "a", None, "b"]


def _peft(base, targets: list[str], params: list[str], seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=params)
    model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


class Moe:
    """The base model, the adapters' folders and PeftModels, and PEFT's tokens per row (once for
    every mode)."""

    def __init__(self, folder) -> None:
        self.base = _qwen3_moe()
        # a: attention and both expert parameters; b: o_proj and the experts' down_proj only
        self.peft = {
            "a": _peft(self.base, ["q_proj", "v_proj"], EXPERTS, 1),
            "b": _peft(self.base, ["o_proj"], EXPERTS[1:], 2),
        }
        self.folders = {}
        for name, m in self.peft.items():
            m.save_pretrained(folder / name)
            self.folders[name] = folder / name
        self.prompts = prompts_of_lengths([5, 17, 9, 12, 3, 20], seed=3)
        models = {None: self.base, **self.peft}
        self.refs = [_generate(models[lo], p) for lo, p in zip(LORAS, self.prompts)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Moe:
    m = Moe(tmp_path_factory.mktemp("lora_experts"))
    # the experts' adapter changes the tokens (a copy with only its attention adapter would not give them)
    assert m.refs[1] != _generate(m.base, m.prompts[1]) and m.refs[5] != _generate(m.base, m.prompts[5])
    return m


def _engine(moe: Moe, **cfg) -> acb.Engine:
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, "max_loras": 2, **cfg})
    eng = acb.Engine(moe.base, config)
    eng.start()
    for name, folder in moe.folders.items():
        eng.add_lora(name, str(folder))
    return eng


def _run(eng: acb.Engine, moe: Moe) -> list[list[int]]:
    res = eng.generate_batch(moe.prompts, max_new_tokens=MAX_NEW, ignore_eos=True, lora=LORAS, progress_bar=False)
    return [o.generated_tokens for o in res.values()]


@pytest.fixture
def experts_rows(moe, monkeypatch):
    """Per step: its token count (the embedding's rows) and the rows layer 0's experts module ran
    (summed over its calls); and the most folded weights alive at once."""
    steps: list[list[int]] = []  # [T, rows through layer 0's experts, ...] per step
    experts = moe.base.model.layers[0].mlp.experts
    cls = type(experts)
    original = cls.forward

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if self is experts and steps:
            steps[-1].append(int(hidden_states.shape[0]))
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)
    handle = moe.base.model.embed_tokens.register_forward_hook(lambda m, i, o: steps.append([o.shape[-2]]))
    alive = [0, 0]  # now, most
    baddbmm = torch.baddbmm

    def counted(*args, **kwargs):
        out = baddbmm(*args, **kwargs)
        if not isinstance(args[0], torch.nn.Parameter):  # (not a fold of an expert parameter)
            return out
        alive[0] += 1
        alive[1] = max(alive)
        weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - 1))
        return out

    monkeypatch.setattr(torch, "baddbmm", counted)
    yield steps, alive
    handle.remove()


MODES = {
    "plain": {},
    "async": {"use_async_batching": True},
    # 8 usable blocks of 8 tokens for 6 requests of up to 28 tokens: preemption, offloaded
    "preempt_offload": {
        "num_blocks": 9,
        "safety_margin": 0.0,
        "allow_block_sharing": False,
        "cpu_offload_space": 0.01,
    },
}


@pytest.mark.parametrize("mode", list(MODES))
def test_expert_parameters_in_a_mixed_batch_equal_peft_generate(moe, mode, monkeypatch):
    seen = []  # each step's LoRA runs
    original = LoraHooks.step

    def step(self, sched, batch):
        if batch.lora is not None:
            seen.append(
                ({s for s, _, _ in batch.lora.runs}, sum(c for *_, c in batch.lora.runs), batch.lora.num_tokens)
            )
        return original(self, sched, batch)

    monkeypatch.setattr(LoraHooks, "step", step)
    eng = _engine(moe, **MODES[mode])
    try:
        assert _run(eng, moe) == moe.refs
        if mode == "preempt_offload":
            assert eng.stats.preemptions > 0 and eng.stats.swapped_out_blocks > 0
        else:  # a step mixed both adapters' rows and base rows
            assert any(slots == {1, 2} and rows < n for slots, rows, n in seen)
    finally:
        eng.shutdown()


def test_each_row_goes_through_the_experts_once(moe, experts_rows):
    """In every step, layer 0's experts module runs each of the step's rows once (the base rows
    with its own weights, each adapter's rows with its folded weights, no row twice), and at most
    one slot's folded weights of one module (two parameters) are alive at a time."""
    steps, alive = experts_rows
    eng = _engine(moe)
    try:
        assert _run(eng, moe) == moe.refs
    finally:
        eng.shutdown()
    assert len(steps) >= MAX_NEW and all(len(s) >= 2 for s in steps)  # (the hooks saw every step)
    assert [sum(s[1:]) for s in steps] == [s[0] for s in steps]
    assert any(len(s) == 4 for s in steps)  # a step with base rows and both adapters' rows: three calls
    assert alive[1] == 2


def test_update_lora_with_expert_tensors_by_key(moe):
    """``update_lora`` with PEFT's keys (``get_peft_model_state_dict``, as an RL trainer's push
    sends them), the fused experts' tensors among them (``<experts>.base_layer.lora_B.weight`` and
    ``<experts>.lora_B.weight`` have one shape here: each must reach its own parameter): the adapter
    runs the new weights exactly as PeftModel.generate, and its uid (the prefix-cache salt) is the
    one loading the new adapter gives."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from acb.lora import load_adapter

    new = _peft(moe.base, ["q_proj", "v_proj"], EXPERTS, 7)
    state = get_peft_model_state_dict(new)
    assert any(".experts.base_layer.lora_B" in k for k in state) and any(".experts.lora_A" in k for k in state)
    # some of the tensors: the experts' lora_B only (the lora_A, the linears' and the scalings kept)
    some = {k: v for k, v in state.items() if ".experts." in k and "lora_B" in k}
    half = copy.deepcopy(moe.peft["a"])
    set_peft_model_state_dict(half, some)
    rows = [i for i, lo in enumerate(LORAS) if lo == "a"]
    want = {m: [_generate(m, moe.prompts[i]) for i in rows] for m in (half, new)}
    assert len({tuple(map(tuple, w)) for w in [*want.values(), [moe.refs[i] for i in rows]]}) == 3  # (can fail)
    eng = _engine(moe)

    def run_a():
        prompts = [moe.prompts[i] for i in rows]
        out = eng.generate_batch(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, lora="a", progress_bar=False)
        return [o.generated_tokens for o in out.values()]

    try:
        eng.loras.check_update("a", [(k, tuple(t.shape), t.dtype) for k, t in state.items()])  # (a server's check)
        key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"
        with pytest.raises(WeightUpdateError, match=r"experts\.lora_A\.weight: shape \[16, 64\], the loaded"):
            eng.update_lora("a", {**state, key: torch.zeros(16, 64)})
        eng.update_lora("a", some)
        assert run_a() == want[half]
        eng.update_lora("a", state)
        assert run_a() == want[new]
        info = {i.name: i for i in eng.list_loras()}["a"]
        assert info.uid == load_adapter(new, moe.base, max_rank=16, name="a").uid
        # in a mixed batch: b's rows and the base rows as before
        assert _run(eng, moe) == [want[new][rows.index(i)] if i in rows else r for i, r in enumerate(moe.refs)]
    finally:
        eng.shutdown()


def test_the_experts_are_priced_before_the_kv_blocks(moe):
    """The experts' factors (max_loras slots at max_lora_rank, every 3-D parameter an adapter could
    target) and the transient folded copy (the largest module's 3-D parameters once) are set aside
    before the KV blocks; a budget they do not fit in is refused naming LoRA."""
    from acb.lora import lora_targets
    from acb.runner.lora import reserved_bytes
    from acb.runner.lora_experts import ExpertAdapters

    base = moe.base
    small = dict(page_size=8, max_model_len=64, max_batch_tokens=64, max_requests_per_batch=8)
    with acb.Engine(base, acb.ContinuousBatchingConfig(**small)) as eng:
        plain = eng.config.num_blocks
        per_block = eng.runner.kv_cache.spec.bytes_per_block(8)
    # 2 layers; per layer gate_up_proj [4, 64, 64] and down_proj [4, 64, 32], float32
    experts = ExpertAdapters.reserved_bytes(base, 2, 4, {})
    assert experts == 2 * (2 * 4 * 4 * ((64 + 64) + (64 + 32)) * 4) + (4 * 64 * 64 + 4 * 64 * 32) * 4
    with acb.Engine(base, acb.ContinuousBatchingConfig(**small, max_loras=2, max_lora_rank=4)) as eng:
        want = reserved_bytes(lora_targets(base), 2, 4) + experts
        assert eng.runner.layout.kind("lora").reserved_bytes == want == eng.config.lora_bytes
        assert eng.config.num_blocks == plain - -(-want // per_block)
    # room for the linears' buffers (11 blocks of 4 KiB) but not for the experts' 26 more
    tight = dict(small, max_requests_per_batch=4)
    with pytest.raises(ValueError, match="not enough memory for LoRA adapters: max_loras=2 of max_lora_rank=4"):
        acb.Engine(base, acb.ContinuousBatchingConfig(**tight, max_loras=2, max_lora_rank=4)).start()


def test_batch_invariant_mode_alone_equals_mixed_chunked_preempted_and_the_peft_forward(moe):
    """The batch-invariant mode with experts' adapters (issue 57): the folded weights run through
    the mode's fixed linear per expert, so a request on adapter ``a`` gives the same tokens and
    logprob bits alone, among the other rows (base, ``a`` and ``b`` mixed) repeated four times,
    chunked at 6 tokens, async and preempted with offload, and on one thread; and PEFT's forward
    (``baddbmm`` fold, the model's own experts) under ``enabled`` computes exactly its logprobs."""
    from acb.runner import batch_invariant as bi
    from tests.runner.test_batch_invariant import SP, TEMP

    target, others = moe.prompts[1], [p for i, p in enumerate(moe.prompts) if i != 1] * 4
    loras = [lo for i, lo in enumerate(LORAS) if i != 1] * 4

    def run(prompts, adapters, **cfg):
        eng = _engine(moe, batch_invariant=True, **{"cpu_threads": 2, **cfg})
        try:
            eng.pause()
            handles = [eng.submit(p, SP, lora=lo) for p, lo in zip(prompts, adapters)]
            eng.resume()
            outs = [h.result() for h in handles]
            preempted = eng.stats.preemptions
        finally:
            eng.shutdown()
        return [(o.generated_tokens, torch.tensor(o.logprobs, dtype=torch.float64)) for o in outs], preempted

    def same(a, b):
        return a[0] == b[0] and torch.equal(a[1], b[1])

    (alone,), _ = run([target], ["a"])
    assert same(run([*others, target], [*loras, "a"])[0][-1], alone)
    assert same(run([target], ["a"], max_batch_tokens=6)[0][0], alone)
    assert same(run([target], ["a"], cpu_threads=1)[0][0], alone)
    outs, preempted = run([*others[:5], target], [*loras[:5], "a"], **MODES["preempt_offload"], use_async_batching=True)
    assert preempted > 0 and same(outs[-1], alone)
    tokens, lps = alone
    with bi.enabled(moe.peft["a"]), torch.no_grad():
        logits = moe.peft["a"](input_ids=torch.tensor([target + tokens])).logits[0, len(target) - 1 : -1]
    assert torch.equal(bi.token_logprobs(logits, tokens, TEMP).double(), lps)
