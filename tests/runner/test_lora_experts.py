"""LoRA on a MoE's fused experts (issue 56): PEFT's ``target_parameters`` (a ``ParamWrapper`` per
3-D expert parameter, the delta folded into the weight before the experts run). A tiny Qwen3-MoE,
two random ``save_pretrained`` adapters (attention linears and both expert parameters; lora_B
randomised), and the base model in one mixed batch: each row's greedy tokens equal
``PeftModel.generate``'s with its adapter active."""

from __future__ import annotations

import copy

import torch

import acb
from acb.runner.kinds import LoraHooks
from tests.conftest import prompts_of_lengths
from tests.runner.test_lora import MAX_NEW, _generate, _qwen3_moe

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


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


def test_expert_parameters_in_a_mixed_batch_equal_peft_generate(tmp_path, monkeypatch):
    base = _qwen3_moe()
    # a: attention and both expert parameters; b: the experts' down_proj only
    peft = {"a": _peft(base, ["q_proj", "v_proj"], EXPERTS, 1), "b": _peft(base, ["o_proj"], EXPERTS[1:], 2)}
    for name, m in peft.items():
        m.save_pretrained(tmp_path / name)
    prompts = prompts_of_lengths([5, 17, 9, 12, 3, 20], seed=3)
    loras = [None, "a", "b", "a", None, "b"]
    models = {None: base, **peft}
    refs = [_generate(models[lo], p) for lo, p in zip(loras, prompts)]
    # the experts' adapter changes the tokens (a copy with only its attention adapter would not give them)
    assert refs[1] != _generate(base, prompts[1]) and refs[5] != _generate(base, prompts[5])
    seen = []  # each step's LoRA runs
    original = LoraHooks.step

    def step(self, sched, batch):
        if batch.lora is not None:
            seen.append(
                ({s for s, _, _ in batch.lora.runs}, sum(c for *_, c in batch.lora.runs), batch.lora.num_tokens)
            )
        return original(self, sched, batch)

    monkeypatch.setattr(LoraHooks, "step", step)
    config = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, max_loras=2)
    with acb.Engine(base, config) as eng:
        for name in peft:
            eng.add_lora(name, str(tmp_path / name))

        def run():
            res = eng.generate_batch(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, lora=loras, progress_bar=False)
            return [o.generated_tokens for o in res.values()]

        assert run() == refs
        # a step mixed both adapters' rows and base rows
        assert any(slots == {1, 2} and rows < n for slots, rows, n in seen)
        # an in-place update of some linears' tensors keeps the experts' factors
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
        eng.update_lora("a", {key: peft["a"].state_dict()[key.replace(".weight", ".default.weight")]})
        assert run() == refs
