"""LoRA adapters in the runner (issue 56): each row of a mixed batch (two adapters and the base model
in one step) gets greedy tokens equal to ``PeftModel.generate`` with its adapter active, on Llama,
Qwen3, a MoE (Qwen3-MoE: its attention linears; PEFT maps its MLP names to the fused experts'
parameters, ``target_parameters``: tests/runner/test_lora_experts.py) and the Qwen3.5 hybrid (attention and MLP
linears; the linears of its state layers, run per request segment, refused). The adapters are real
``save_pretrained`` folders of random PEFT adapters (lora_B randomised: PEFT inits it to zero),
loaded by :func:`acb.lora.load_adapter` through ``engine.add_lora``. Both forms of the update
(grouped, gathered) are checked; and the refusals, the kind's bytes, the memory budget."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import acb
import acb.runner.lora as runner_lora
from acb.errors import InvalidRequestError
from acb.lora import load_adapter
from acb.runner.kinds import LoraHooks
from tests.conftest import prompts_of_lengths

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
MAX_NEW = 8


def _qwen3_moe():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _qwen3_5():
    from transformers import AutoModelForCausalLM

    from tests.api.test_hybrid import _config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("qwen3_5")).eval()
    assert set(model.config.layer_types) == {"linear_attention", "full_attention"}  # every layer kind kept
    return model


def _base(arch: str):
    from acb.models import tiny_model

    if arch == "qwen3_moe":
        return _qwen3_moe()
    if arch == "qwen3_5":
        return _qwen3_5()
    return tiny_model(arch)


# arch -> (adapter a's targets, adapter b's targets)
TARGETS = {
    "llama": (["q_proj", "v_proj", "down_proj"], ATTN + MLP),
    "qwen3": (ATTN, ["v_proj", "gate_proj", "up_proj"]),
    "qwen3_moe": (ATTN, ["k_proj", "o_proj"]),  # (its experts: target_parameters, test_lora_experts.py)
    "qwen3_5": (ATTN + MLP, ["q_proj", "o_proj", "up_proj"]),
}


def _peft(base, targets: list[str], seed: int, **kw):
    """A random PEFT adapter on a copy of ``base`` (lora_B randomised), in eval mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=targets, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


def _generate(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


class Setup:
    def __init__(self, arch: str, folder) -> None:
        self.base = _base(arch)
        ta, tb = TARGETS[arch]
        self.peft = {"a": _peft(self.base, ta, 1), "b": _peft(self.base, tb, 2)}
        self.folders = {}
        for name, m in self.peft.items():
            m.save_pretrained(folder / name)
            self.folders[name] = folder / name
        self.prompts = prompts_of_lengths([5, 17, 9, 12, 3, 20], seed=3)
        self.loras = [None, "a", "b", "a", None, "b"]
        models = {None: self.base, **self.peft}
        self.refs = [_generate(models[lo], p) for lo, p in zip(self.loras, self.prompts)]


_SETUPS: dict[str, Setup] = {}


def _setup(arch: str, tmp_path_factory) -> Setup:
    if arch not in _SETUPS:
        _SETUPS[arch] = Setup(arch, tmp_path_factory.mktemp(f"lora_{arch}"))
    return _SETUPS[arch]


@pytest.fixture(scope="module", params=sorted(TARGETS))
def setup(request, tmp_path_factory):
    return _setup(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One architecture is enough for the modes and the switch (tests/api/test_lora.py covers more)."""
    return _setup("llama", tmp_path_factory)


@pytest.fixture
def recorded_runs(monkeypatch):
    """Each step's LoRA runs (slot, start, count) and token count, as the interception sees them."""
    seen: list[tuple[list[tuple[int, int, int]], int]] = []
    original = LoraHooks.step

    def step(self, sched, batch):
        if batch.lora is not None:
            seen.append((list(batch.lora.runs), batch.lora.num_tokens))
        return original(self, sched, batch)

    monkeypatch.setattr(LoraHooks, "step", step)
    return seen


def _run(s: Setup, **cfg) -> list[list[int]]:
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, "max_loras": 2, **cfg})
    with acb.Engine(s.base, config) as eng:
        for name, folder in s.folders.items():
            eng.add_lora(name, str(folder))
        res = eng.generate_batch(s.prompts, max_new_tokens=MAX_NEW, ignore_eos=True, lora=s.loras, progress_bar=False)
        return [o.generated_tokens for o in res.values()]


def test_a_mixed_batch_equals_peft_generate_row_by_row(setup, recorded_runs):
    """Two adapters and none in one step: every row's greedy tokens are PeftModel.generate's with its
    adapter active (the base rows: the base model's)."""
    assert setup.refs[1] != _generate(setup.base, setup.prompts[1])  # the adapter changes the tokens
    assert _run(setup) == setup.refs
    # the engine did mix them: a step with both adapters' rows and base rows
    assert any({s for s, _, _ in runs} == {1, 2} and sum(c for *_, c in runs) < n for runs, n in recorded_runs)


@pytest.mark.parametrize("cfg", [dict(max_batch_tokens=8), dict(use_async_batching=True)], ids=["chunked", "async"])
def test_chunked_and_async(llama, cfg):
    assert _run(llama, **cfg) == llama.refs


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "grouped"])
def test_each_form_gives_the_same_tokens(llama, monkeypatch, gathered):
    """Each form of the update, forced (``runner.lora.GATHERED``; the default, None, picks per step), gives
    PeftModel.generate's tokens."""
    monkeypatch.setattr(runner_lora, "GATHERED", gathered)
    assert _run(llama) == llama.refs


def test_the_per_step_pick_chooses_by_slots_and_rows(monkeypatch):
    """``GATHERED = None``: a step takes the gathered form when it has more than
    ``GATHER_MIN_SLOTS`` slots and at most ``GATHER_MAX_ROWS`` adapter rows (many adapters of few
    rows each: one batched pair of ``bmm`` beats a pair of matmuls per slot), else the grouped form."""
    from acb.runner.input_batch import LoraRows

    def rows(n_slots: int, n_rows: int) -> LoraRows:
        runs = [
            (s + 1, s * n_rows // n_slots, (s + 1) * n_rows // n_slots - s * n_rows // n_slots) for s in range(n_slots)
        ]
        return LoraRows(torch.arange(n_rows), torch.ones(n_rows, dtype=torch.long), runs, n_rows)

    monkeypatch.setattr(runner_lora, "GATHERED", None)
    lo, hi = runner_lora.GATHER_MIN_SLOTS, runner_lora.GATHER_MAX_ROWS
    assert (lo, hi) == (6, 256)
    assert not runner_lora._gathered(rows(1, 4))  # one adapter
    assert not runner_lora._gathered(rows(lo, 2 * lo))  # few slots
    assert runner_lora._gathered(rows(lo + 1, 2 * lo + 2))  # many slots, few rows (a decode step of 16 adapters)
    assert runner_lora._gathered(rows(16, hi))
    assert not runner_lora._gathered(rows(16, hi + 1))  # many rows (prefill): B's per-row copies grow
    monkeypatch.setattr(runner_lora, "GATHERED", False)  # a forced form is not picked
    assert not runner_lora._gathered(rows(16, 32))
    monkeypatch.setattr(runner_lora, "GATHERED", True)
    assert runner_lora._gathered(rows(1, 4))


def test_a_step_picked_either_way_gives_peft_tokens(llama, monkeypatch):
    """With the pick on and its thresholds lowered so that one run takes both forms (decode steps
    of both adapters: gathered; prefill steps and steps of one adapter: grouped), every row gets
    PeftModel.generate's tokens."""
    monkeypatch.setattr(runner_lora, "GATHERED", None)
    monkeypatch.setattr(runner_lora, "GATHER_MIN_SLOTS", 1)
    monkeypatch.setattr(runner_lora, "GATHER_MAX_ROWS", 6)
    picks: list[bool] = []
    pick = runner_lora._gathered

    def recorded(rows):
        picks.append(pick(rows))
        return picks[-1]

    monkeypatch.setattr(runner_lora, "_gathered", recorded)
    assert _run(llama) == llama.refs
    assert set(picks) == {True, False}


def test_grouped_and_gathered_updates_agree_on_one_linear():
    from acb.lora import LoraAdapter
    from acb.runner.input_batch import LoraRows
    from acb.runner.lora import LoraLayers, LoraStep
    from acb.runner.step import entered

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24))
    layers = LoraLayers(model, 3, 8, torch.device("cpu"))
    lin = model[0]
    for slot, r in ((1, 4), (3, 8)):
        w = {"0": (torch.randn(r, 16), torch.randn(24, r))}
        layers.add(slot, LoraAdapter(f"s{slot}", r, 0.5 * slot, w, b"", 0, {"0": 0.5 * slot}))
    x = torch.randn(1, 10, 16)
    slots = torch.tensor([0, 1, 3, 1, 0, 3, 3, 1, 0, 0])
    order = torch.argsort(slots, stable=True)[4:]
    runs = [(1, 0, 3), (3, 3, 3)]
    rows = LoraRows(order, slots[order], runs, 10)
    want = lin(x).clone()
    for i, s in enumerate(slots.tolist()):
        if s:
            a, b = layers.buffers[lin].A[s], layers.buffers[lin].B[s]
            want[0, i] += (x[0, i] @ a.T @ b.T) * 0.5 * s
    got = {}
    default = runner_lora.GATHERED
    try:
        for gathered in (False, True):
            runner_lora.GATHERED = gathered
            with entered("lora", LoraStep(layers, rows)):
                got[gathered] = lin(x)
    finally:
        runner_lora.GATHERED = default
        layers.close()
    assert torch.allclose(got[False], want, atol=1e-5) and torch.allclose(got[True], want, atol=1e-5)
    assert "forward" not in vars(lin)  # the linear has its own forward back


def test_graph_replays_leave_out_steps_of_experts_adapters():
    """A decode step replays the graphs' LoRA form unless one of its slots has fused experts'
    factors (run once more per slot present: a host-dependent shape); ``prepare_graphs`` gives
    every target buffers and the interception, all slots empty."""
    from acb.models import tiny_model
    from acb.runner.input_batch import LoraRows
    from acb.runner.lora import LoraLayers

    model = tiny_model("llama")
    layers = LoraLayers(model, 3, 4, torch.device("cpu"))
    try:

        def rows(*slots: int) -> LoraRows:
            return LoraRows(torch.arange(len(slots)), torch.tensor(slots), [(s, i, 1) for i, s in enumerate(slots)], 4)

        assert layers.graphable(rows(1, 2, 3))
        layers.experts.per_module[model.model.layers[0].mlp] = {2: {}}  # (as ExpertAdapters.put leaves it)
        assert layers.graphable(rows(1, 3)) and not layers.graphable(rows(1, 2))
        layers.prepare_graphs()
        assert set(layers.buffers) == set(layers.targets.values())
        assert all("forward" in vars(lin) for lin in layers.targets.values())
        assert all(not b.A.any() and not b.scale_f32.any() for b in layers.buffers.values())
    finally:
        layers.close()
    assert all("forward" not in vars(lin) for lin in layers.targets.values())


def test_the_kind_and_its_bytes_priced_before_the_kv_blocks():
    from acb.lora import lora_targets
    from acb.models import tiny_model
    from acb.runner.lora import reserved_bytes

    model = tiny_model("llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8)) as eng:
        plain = eng.config.num_blocks
        assert eng.runner.layout.kind("lora") is None and eng.runner.lora is None
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, max_loras=3, max_lora_rank=4)) as eng:
        kind = eng.runner.layout.kind("lora")
        want = reserved_bytes(lora_targets(model), 3, 4)
        # every decoder linear (7 per layer), 4 slots of rank 4: (in + out) * 4 + a scale, float32
        assert want == sum(4 * (4 * (m.in_features + m.out_features) + 1) * 4 for m in lora_targets(model).values())
        assert len(lora_targets(model)) == 7 * model.config.num_hidden_layers  # (not the head)
        assert kind is not None and kind.reserved_bytes == want == eng.config.lora_bytes
        per_block = eng.runner.kv_cache.spec.bytes_per_block(8)
        assert eng.config.num_blocks == plain - -(-want // per_block)
        assert (eng.config.max_loras, eng.config.max_lora_rank) == (3, 4)


def test_refusals_say_what_and_why(tmp_path):
    from acb.models import tiny_model

    base = tiny_model("llama")
    peft = _peft(base, ["q_proj"], 1)
    peft.save_pretrained(tmp_path / "ok")

    def refused(source, match, **kw):
        with pytest.raises(InvalidRequestError, match=match) as info:
            load_adapter(source, base, name="x", **{"max_rank": 16, **kw})
        assert info.value.field == "lora"

    refused(tmp_path / "ok", r"rank 8 .* over max_lora_rank=4", max_rank=4)
    refused(tmp_path / "missing", "is not a folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no adapter_config.json")
    # a module the model does not have
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((tmp_path / "ok" / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "ok" / "adapter_model.safetensors"))
    save_file({k.replace("self_attn", "attn"): v for k, v in tensors.items()}, str(bad / "adapter_model.safetensors"))
    refused(bad, r"target module 'model\.layers\.0\.attn\.q_proj' is not in the model")
    # PEFT options acb does not run
    for key, value, match in (
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("bias", "all", "biases"),
    ):
        folder = tmp_path / key
        folder.mkdir()
        cfg = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
        cfg[key] = value
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        refused(folder, match)
    # a MoE's experts are fused parameters: PEFT targets them with target_parameters, taken as
    # LoraAdapter.params (run in tests/runner/test_lora_experts.py)
    moe = _qwen3_moe()
    got = load_adapter(_peft(moe, ["q_proj", "down_proj"], 1), moe, max_rank=16, name="m")
    assert set(got.params) == {f"model.layers.{i}.mlp.experts.down_proj" for i in range(2)}
    with pytest.raises(InvalidRequestError, match=r"rank 8 \(parameter .*experts\.down_proj.*max_lora_rank=4"):
        load_adapter(_peft(moe, ["q_proj", "down_proj"], 1), moe, max_rank=4, name="m")
    # the head is not a decoder linear
    refused(_peft(base, ["lm_head"], 1), "nn.Linear layers of the model's decoder only")
    # a PeftModel source loads the same adapter as its folder
    a, b = load_adapter(peft, base, max_rank=16, name="p"), load_adapter(tmp_path / "ok", base, max_rank=16, name="f")
    assert a.uid == b.uid and a.scaling == 2.0 and a.rank == 8 and set(a.weights) == set(b.weights)


def test_rank_and_alpha_patterns_and_rslora(tmp_path):
    """Per-module ranks and alphas (PEFT's patterns) and rsLoRA's scaling, through an engine."""
    from acb.models import tiny_model

    base = tiny_model("llama")
    peft = _peft(base, ["q_proj", "v_proj"], 4, rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 32})
    rs = _peft(base, ["k_proj", "down_proj"], 5, use_rslora=True)
    peft.save_pretrained(tmp_path / "pat")
    rs.save_pretrained(tmp_path / "rs")
    ad = load_adapter(tmp_path / "pat", base, max_rank=16, name="pat")
    assert ad.scalings["model.layers.0.self_attn.q_proj"] == 32 / 8
    assert ad.scalings["model.layers.0.self_attn.v_proj"] == 16 / 4
    assert load_adapter(tmp_path / "rs", base, max_rank=16, name="rs").scaling == 16 / 8**0.5
    prompts = prompts_of_lengths([6, 11], seed=5)
    refs = [_generate(peft, prompts[0]), _generate(rs, prompts[1])]
    with acb.Engine(base, acb.ContinuousBatchingConfig(num_blocks=32, page_size=8, max_loras=2)) as eng:
        eng.add_lora("pat", str(tmp_path / "pat"))
        eng.add_lora("rs", str(tmp_path / "rs"))
        res = eng.generate_batch(
            prompts, max_new_tokens=MAX_NEW, ignore_eos=True, lora=["pat", "rs"], progress_bar=False
        )
        assert [o.generated_tokens for o in res.values()] == refs


def test_where_lora_does_not_run_yet(tmp_path):
    from acb.models import tiny_model

    with pytest.raises(ValueError, match="paged path only.*runner='own_cache'"):
        acb.Engine(tiny_model("llama"), acb.ContinuousBatchingConfig(runner="own_cache", max_loras=1)).start()
    # a linear inside a state layer (run per request segment) is refused when added
    base = _qwen3_5()
    _peft(base, ["in_proj_qkv"], 1).save_pretrained(tmp_path / "state")
    with acb.Engine(base, acb.ContinuousBatchingConfig(num_blocks=32, page_size=8, max_loras=1)) as eng:
        with pytest.raises(InvalidRequestError, match="acb runs per request segment"):
            eng.add_lora("state", str(tmp_path / "state"))
