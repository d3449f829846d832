"""``acb serve`` with LoRA adapters (issue 56 item 3), one server in a subprocess, driven with the
``openai`` client: ``--lora-modules a=PATH`` served as the model ``a`` (greedy text equal to
``PeftModel.generate`` with that adapter), the served name giving the base model's text,
``/v1/models`` listing the adapter with its ``parent``, and vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (``--enable-lora-updates``; refused without it). The adapters are
random PEFT adapters saved with ``save_pretrained``, as a user's."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
peft = pytest.importorskip("peft")

import torch  # noqa: E402

from tests.serve.helpers import check_error_body, raw, tiny_checkpoint  # noqa: E402
from tests.serve.test_openai_server import CHAT_TEMPLATE, SMALL_KV, Server, decode  # noqa: E402

NAME = "tiny-base"
PROMPT = [40, 71, 99, 12, 230, 5, 77, 150, 33, 18, 64]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, a PeftModel over it with adapters ``a`` (attention and MLP) and ``b``
    (attention, rsLoRA), each saved to its own folder."""
    from transformers import AutoModelForCausalLM

    ck = tiny_checkpoint(tmp_path_factory, "lora-base", CHAT_TEMPLATE, 512)
    ref = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(ck.dir),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
        adapter_name="peft_a",
    )
    ref.add_adapter("peft_b", peft.LoraConfig(r=4, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "o_proj"]))
    g = torch.Generator().manual_seed(0)
    for name, p in ref.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.3
    ref.eval()
    root = tmp_path_factory.mktemp("adapters")
    for name in ("a", "b"):
        ref.save_pretrained(root / name, selected_adapters=[f"peft_{name}"])
    folders = {n: next((root / n).rglob("adapter_config.json")).parent for n in ("a", "b")}
    return ck, ref, folders


def _generate(ref, adapter: str | None, n: int = 8) -> list[int]:
    kw = dict(
        input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), max_new_tokens=n
    )
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                out = ref.generate(**kw, do_sample=False)
        else:
            ref.set_adapter(f"peft_{adapter}")
            out = ref.generate(**kw, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    ck, _, folders = setup
    s = Server(
        ck.dir,
        [
            "--served-model-name",
            NAME,
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"a={folders['a']}",
            "--enable-lora-updates",
            *SMALL_KV,
        ],
        tmp_path_factory.mktemp("serve-logs") / "lora.log",
    )
    try:
        s.wait_ready()
        yield s
    finally:
        rc = s.stop()
    assert rc in (0, None), f"acb serve exited with {rc} on SIGTERM:\n{s.tail()}"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def test_the_model_field_selects_the_adapter(client, setup):
    ck, ref, _ = setup
    want_a, want_base = _generate(ref, "a"), _generate(ref, None)
    assert want_a != want_base  # (the adapter changes the text: the test can fail)
    got = client.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.model == "a" and got.choices[0].text == decode(ck.tok, want_a)
    base = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert base.model == NAME and base.choices[0].text == decode(ck.tok, want_base)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {NAME, "a"}
    assert models["a"].parent == NAME and models["a"].root.endswith("peft_a")  # (its folder)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="zz", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and "'a'" in e.value.message


def test_load_and_unload_an_adapter_while_serving(client, server, setup):
    ck, ref, folders = setup
    status, _, body = raw(
        server.port, "POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(folders["b"])}
    )
    assert status == 200, body
    out = client.completions.create(model="b", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == decode(ck.tok, _generate(ref, "b"))
    assert {m.id for m in client.models.list().data} == {NAME, "a", "b"}
    # refusals: a loaded name, no free slot (max_loras 2), a malformed body
    for payload, says, param in [
        ({"lora_name": "b", "lora_path": str(folders["b"])}, "already loaded", "lora_path"),
        ({"lora_name": "c", "lora_path": str(folders["b"])}, "all 2 LoRA slots are taken", "lora_path"),
        ({"lora_name": "c"}, "lora_path", "lora_path"),
    ]:
        _refused(server, "/v1/load_lora_adapter", payload, says, param)
    status, _, body = raw(server.port, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    _refused(server, "/v1/unload_lora_adapter", {"lora_name": "b"}, "cannot be found", "lora_name", 404)
    # a folder without an adapter (a slot is free again)
    _refused(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "c", "lora_path": str(ck.dir)},
        "no adapter_config.json",
        "lora_path",
    )
    assert {m.id for m in client.models.list().data} == {NAME, "a"}


def _refused(server, path: str, payload: dict, says: str, param: str, status: int = 400) -> None:
    got, _, body = raw(server.port, "POST", path, payload)
    err = check_error_body(body, got)
    assert got == status and err["param"] == param and says in err["message"], (got, err)


def test_the_routes_are_refused_without_the_flag(setup):
    """Without ``enable_lora_updates`` the two routes answer 404 and say why (in process: no
    engine needs to run for a refusal)."""
    from fastapi.testclient import TestClient

    import acb
    from acb.serve.app import build_app
    from acb.serve.settings import ServerSettings

    ck, _, folders = setup
    app = build_app(acb.AsyncEngine(ck.model), ServerSettings(name=NAME))
    http = TestClient(app)  # (not entered: the engine is not started)
    for path, payload in [
        ("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(folders["b"])}),
        ("/v1/unload_lora_adapter", {"lora_name": "a"}),
    ]:
        r = http.post(path, json=payload)
        assert r.status_code == 404
        assert "--enable-lora-updates" in r.json()["error"]["message"]
