"""``acb.ContinuousBatchingConfig`` is a drop-in for transformers' (every field, the deprecated
aliases, a transformers instance itself), validates at the boundary, and never ignores a field
silently."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import warnings

import pytest
import transformers

import acb
from acb.config import DEPRECATED, NOT_YET_SUPPORTED, as_config, transformers_fields
from acb.runner.setup import block_size_for
from tests.conftest import get_model

TF = transformers.ContinuousBatchingConfig
ACB_FIELDS = {f.name: f for f in dataclasses.fields(acb.ContinuousBatchingConfig) if f.init}

# a non-default value for every field of transformers' config; a field added to transformers
# fails test_every_transformers_field_is_accepted until it gets one here (and a home in acb)
NON_DEFAULT = {
    "page_size": 16,
    "num_blocks": 64,
    "max_batch_tokens": 128,
    "max_memory_percent": 0.5,
    "max_requests_per_batch": 8,
    "max_blocks_per_request": 4,
    "allow_block_sharing": False,
    "use_async_batching": False,
    "use_cuda_graph": (False, True),
    "q_padding_interval_size": 8,
    "kv_padding_interval_size": 64,
    "varlen_compile_config": transformers.CompileConfig(dynamic=True),
    "decode_compile_config": transformers.CompileConfig(mode="default"),
    "default_compile_level": 2,
    "scheduler_type": "prefill_first",
    "safety_margin": 0.1,
    "return_logprobs": True,
    "seed": 1234,
    "auto_switch_to_flash": False,
    "cpu_offload_space": 0.5,
    "cpu_offload_space_safety_threshold": 0.5,
    "max_queue_size": 10,
    "per_request_processors": True,
    "drop_unsupported_processors": False,
    "disable_nccl_graph_mixing": False,
    "cpu_group_timeout": 60.0,
    "use_default_compile_configs": True,
    "max_cached_graphs": 4,
    "block_size": 16,
}
# deprecated field -> (the field its value lands on, the value there), as in transformers
ALIASES = {
    "block_size": ("page_size", 16),
    "use_default_compile_configs": ("default_compile_level", 3),
    "max_cached_graphs": (None, None),  # no effect (in transformers either); the deprecation names it
}
# what acb accepts but does not act on (each warns by name): changing this set is a decision
UNSUPPORTED = {
    "max_blocks_per_request",
    "kv_padding_interval_size",
    "auto_switch_to_flash",
    "disable_nccl_graph_mixing",
    "cpu_group_timeout",
}
# acb's defaults differ from transformers' only here (documented in the class docstring)
DIFFERENT_DEFAULTS = {"page_size": (None, 256)}


@pytest.fixture
def model():
    return get_model("llama")


@pytest.fixture
def tf_logs():
    """Messages transformers logs (its library logger does not propagate to pytest's caplog)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    root = logging.getLogger("transformers")
    handler, level = Collect(level=logging.WARNING), root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # another test (the CLI's) may have silenced it
    yield messages
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def acb_logs(caplog):
    caplog.set_level(logging.WARNING, logger="acb.config")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "acb.config"]


# --------------------------------------------------------------------------- every field, same name
def test_transformers_class_is_walked():
    names = list(transformers_fields(TF))
    assert "page_size" in names and "auto_switch_to_flash" in names and len(names) >= 29


@pytest.mark.parametrize("name", list(transformers_fields(TF)))
def test_every_transformers_field_is_accepted(name, acb_logs):
    assert name in ACB_FIELDS, f"transformers' ContinuousBatchingConfig.{name} is not a field of acb's"
    assert name in NON_DEFAULT, f"transformers has a new field {name!r}: give it a test value here and map it in acb"
    value = NON_DEFAULT[name]
    assert value != transformers_fields(TF)[name], f"the test value of {name} is transformers' default"
    tf = TF(**{name: value})
    direct = acb.ContinuousBatchingConfig(**{name: value})
    converted = as_config(tf)
    assert isinstance(converted, acb.ContinuousBatchingConfig)
    for cfg in (direct, converted):
        if name in DEPRECATED:
            target, expected = ALIASES[name]
            if target is not None:
                assert getattr(cfg, target) == expected
            assert cfg.warn_unsupported() == []
        elif name in UNSUPPORTED:
            assert getattr(cfg, name) == value
            with pytest.warns(UserWarning, match=rf"ContinuousBatchingConfig\.{name}="):
                assert cfg.warn_unsupported() == [name]
        else:  # honoured: the value arrives, nothing warns
            assert getattr(cfg, name) == value
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert cfg.warn_unsupported() == []
    if name in DEPRECATED:  # the direct construction says so, by name; the conversion does not repeat it
        assert len(acb_logs()) == 1 and acb_logs()[0].startswith(f"{name} is deprecated")


def test_defaults_match_transformers():
    tf_defaults = transformers_fields(TF)
    for name, default in tf_defaults.items():
        ours = ACB_FIELDS[name].default
        if name in DIFFERENT_DEFAULTS:
            assert (ours, default) == DIFFERENT_DEFAULTS[name], f"{name}: default changed"
        else:
            assert ours == default, f"{name}: acb's default {ours!r} != transformers' {default!r}"


def test_field_order_matches_transformers():
    # positional construction means the same thing in both (transformers' fields come first)
    assert list(ACB_FIELDS)[: len(transformers_fields(TF))] == list(transformers_fields(TF))


# --------------------------------------------------------------------------- deprecated aliases
@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 16},
        {"block_size": 16, "page_size": 64},  # the deprecated alias wins, as in transformers
        {"use_default_compile_configs": True},
        {"use_default_compile_configs": False, "default_compile_level": 2},
        {"max_cached_graphs": 4},
    ],
    ids=str,
)
def test_deprecations_mirror_transformers(kwargs, tf_logs, acb_logs):
    tf = TF(**kwargs)
    ours = acb.ContinuousBatchingConfig(**kwargs)
    assert acb_logs() == tf_logs and len(tf_logs) == 1  # same message, logged once, same level
    for name in ("default_compile_level", *kwargs):
        assert getattr(ours, name) == getattr(tf, name), name
    if "block_size" in kwargs:
        assert ours.page_size == tf.page_size == kwargs["block_size"]
        assert as_config(tf).page_size == kwargs["block_size"]
    assert as_config(tf).default_compile_level == tf.default_compile_level
    assert len(acb_logs()) == 1  # converting does not warn again


def test_block_size_alias_reaches_the_engine(model, acb_logs):
    with acb.Engine(model, acb.ContinuousBatchingConfig(block_size=16, num_blocks=16)) as eng:
        assert eng.config.block_size == 16
    assert any("block_size is deprecated: please use page_size" in m for m in acb_logs())


def test_page_size_does_not_warn(acb_logs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = acb.ContinuousBatchingConfig(page_size=16)
        cfg.warn_unsupported()
    assert cfg.page_size == 16 and cfg.block_size is None and acb_logs() == []


# --------------------------------------------------------------------------- a transformers instance
def test_transformers_page_size_sets_engine_block_size(model):
    with acb.Engine(model, TF(page_size=8, num_blocks=16)) as eng:
        assert eng.cb_config.page_size == 8
        assert eng.config.block_size == 8
        assert len(eng.generate([5, 6, 7], acb.SamplingParams(max_new_tokens=3)).generated_tokens) == 3
    # transformers' default page size (256) is left to acb's default
    with acb.Engine(model, TF(num_blocks=16)) as eng:
        assert eng.cb_config.page_size is None
        assert eng.config.block_size == block_size_for(eng.config.attn_backend, None)


def test_generate_batch_and_manager_take_a_transformers_config(model):
    tf = TF(page_size=8, num_blocks=16, kv_padding_interval_size=64, per_request_processors=True)
    with pytest.warns(UserWarning, match=r"ContinuousBatchingConfig\.kv_padding_interval_size="):
        out = acb.generate_batch(
            model, [[5, 6], [7, 8, 9]], continuous_batching_config=tf, max_new_tokens=2, progress_bar=False
        )
    assert [len(o.generated_tokens) for o in out.values()] == [2, 2]
    with pytest.warns(UserWarning, match="kv_padding_interval_size"):
        manager = acb.init_continuous_batching(model, continuous_batching_config=tf)
    assert manager.engine.cb_config.page_size == 8 and manager.engine.cb_config.per_request_processors
    assert manager.continuous_batching_config is tf  # the caller's object, as in transformers


def test_unsupported_set():
    assert set(NOT_YET_SUPPORTED) == UNSUPPORTED


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
@pytest.mark.parametrize("kind", ["acb", "transformers"])
def test_unsupported_fields_warn_by_name_at_engine_start(model, name, kind):
    cfg = (acb.ContinuousBatchingConfig if kind == "acb" else TF)(**{name: NON_DEFAULT[name]})
    with pytest.warns(UserWarning, match=rf"ContinuousBatchingConfig\.{name}=.*has no effect") as rec:
        acb.Engine(model, cfg)
    assert len(rec) == 1


def test_defaults_do_not_warn(model):
    tf = TF()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acb.Engine(model, tf)
        acb.Engine(model, acb.ContinuousBatchingConfig())
        acb.Engine(model)


def test_unknown_transformers_field_warns_by_name():
    @dataclasses.dataclass
    class Newer(TF):  # a later transformers with a field acb does not know yet
        new_knob: int = 0

    with pytest.warns(UserWarning, match="new_knob"):
        cfg = as_config(Newer(new_knob=1, page_size=16))
    assert cfg.page_size == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        as_config(Newer())


def test_older_transformers_block_size_is_the_page_size():
    """transformers 5.17-5.22 (the GPU image has 5.17) name the page size block_size, default
    256, and have no page_size: a non-default block_size there is the page size."""

    @dataclasses.dataclass
    class ContinuousBatchingConfig:
        block_size: int = 256
        num_blocks: int | None = None

    ContinuousBatchingConfig.__module__ = "transformers.generation.configuration_utils"
    assert as_config(ContinuousBatchingConfig(block_size=16, num_blocks=40)).page_size == 16
    assert as_config(ContinuousBatchingConfig()).page_size is None  # transformers' default: acb's


def test_conversion_validates():
    with pytest.raises(ValueError, match="safety_margin"):
        as_config(TF(safety_margin=1.5))
    with pytest.raises(ValueError, match="scheduler_type"):
        as_config(TF(scheduler_type="lifo"))


def test_lookalike_class_is_not_converted():
    class ContinuousBatchingConfig:  # same name, not transformers'
        page_size = 8

    with pytest.raises(TypeError, match="transformers.ContinuousBatchingConfig"):
        as_config(ContinuousBatchingConfig())
    with pytest.raises(TypeError, match="expected a transformers"):
        acb.ContinuousBatchingConfig.from_transformers(acb.ContinuousBatchingConfig())


def test_import_acb_does_not_import_transformers():
    code = (
        "import sys, acb; from acb.config import as_config; as_config(None); "
        "acb.ContinuousBatchingConfig(page_size=8); assert 'transformers' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "config,match",
    [
        ({"page_size": 8}, "got dict .for a dict, pass acb.ContinuousBatchingConfig"),
        ("fast", "got str"),
        (TF, "got type"),  # the class, not an instance
    ],
)
def test_wrong_config_type_refused(model, config, match):
    with pytest.raises(
        TypeError, match="config must be an acb.ContinuousBatchingConfig or a transformers.ContinuousBatchingConfig"
    ) as e:
        acb.Engine(model, config)
    assert e.match(match)
    with pytest.raises(TypeError, match="config must be"):
        acb.generate_batch(model, [[5, 6]], continuous_batching_config=config, progress_bar=False)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"page_size": "8"}, "page_size must be a positive int, got '8'"),
        ({"page_size": True}, "page_size must be a positive int"),
        ({"page_size": 0}, "page_size must be a positive int"),
        ({"block_size": 2.5}, "page_size must be a positive int"),  # the alias lands on page_size first
        ({"num_blocks": 1}, "num_blocks must be >= 2"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"scheduler_type": "lifo"}, "scheduler_type must be one of"),
        ({"use_cuda_graph": (True,)}, "use_cuda_graph"),
        ({"q_padding_interval_size": -8}, "q_padding_interval_size must be an int >= 0"),
        ({"allow_block_sharing": "no"}, "allow_block_sharing must be a bool"),
        ({"auto_switch_to_flash": None}, "auto_switch_to_flash must be a bool"),
        ({"use_async_batching": 1}, "use_async_batching must be None or a bool"),
        ({"seed": 1.5}, "seed must be None or an int"),
        ({"max_memory_percent": "0.5"}, "max_memory_percent must be in"),
        ({"max_memory_percent": 90}, "max_memory_percent must be in"),
        ({"safety_margin": 1.0}, "safety_margin must be in"),
        ({"cpu_offload_space": -1}, "cpu_offload_space must be"),
        ({"default_compile_level": -1}, "default_compile_level must be an int >= 0"),
        ({"max_queue_size": None}, "max_queue_size must be an int >= 0"),
        ({"attn_backend": "sdpa"}, "attn_backend must be one of"),
    ],
)
def test_bad_field_values_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        acb.ContinuousBatchingConfig(**kwargs)


def test_unsupported_warns_once_per_config():
    cfg = acb.ContinuousBatchingConfig(kv_padding_interval_size=64, cpu_group_timeout=None)
    with pytest.warns(UserWarning) as rec:
        assert cfg.warn_unsupported() == ["kv_padding_interval_size", "cpu_group_timeout"]
    assert len(rec) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cfg.warn_unsupported() == ["kv_padding_interval_size", "cpu_group_timeout"]
