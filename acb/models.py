"""Random-weight models built from configs, and a tokenizer built in code (no downloads).

Used by the tests, the benchmarks and ``acb generate``'s default model. Their weights are
random, so the text they produce is meaningless: they exist to exercise and time the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

# Small shapes per architecture; every field a tiny model needs to be exercised properly
# (GQA, head_dim not hidden/heads, sliding windows, q/k norms...).
_TINY: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen2": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=24,
    ),
    "gemma": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
    ),
    "gemma2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=16,
    ),
    "gemma3_text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "phi3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    ),
}

TINY_ARCHS = tuple(_TINY)


def tiny_config(
    arch: str, *, vocab_size: int = 256, max_position_embeddings: int = 1024, **overrides: Any
) -> PreTrainedConfig:
    """The config of a tiny ``arch`` model (``TINY_ARCHS``); ``overrides`` replace its fields."""
    from transformers import AutoConfig

    if arch not in _TINY:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")
    kw = dict(_TINY[arch])
    kw.update(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    # a wider init makes logits peaked, so greedy parity does not hinge on near-ties
    kw["initializer_range"] = 0.2
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny random causal LM of the given architecture, in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


# ``acb generate``'s embedded default: a small Llama (3.3M parameters; docs/getting-started.md shows the
# count computed from the model, and tests/test_docs_examples.py runs that block).
DEFAULT_MODEL_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


def default_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """``acb generate``'s default model: random weights, :data:`DEFAULT_MODEL_CONFIG`, the vocabulary of
    :func:`build_tokenizer` (no download). Its text is meaningless: it is there to try and time acb.

    Args:
        seed: the seed of the random weights.
        dtype: the weights' dtype.

    Returns:
        A Llama of 3.3M parameters, in eval mode, on the CPU.
    """
    tok = build_tokenizer()
    return tiny_model("llama", seed=seed, dtype=dtype, vocab_size=len(tok), **DEFAULT_MODEL_CONFIG)


SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: pad, bos, eos

# The embedded tokenizer's chat template: ``role: content`` lines, then ``assistant: `` for a
# generation prompt. With ``tools`` it lists them first (one JSON object a line), an assistant
# message's ``tool_calls`` follow its content as Hermes-style ``<tool_call>`` objects (what
# ``acb serve --tool-call-parser hermes`` reads back), and a ``tool`` message names the call it
# answers. A plain chat renders as ``acb generate``'s template did before the tokenizer had one.
CHAT_TEMPLATE = (
    "{% if tools %}tools:\n{% for t in tools %}{{ (t.function if t.function is defined else t) | tojson }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string else '' }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{% set f = c.function if c.function is defined else c %}"
    '<tool_call>{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments | tojson }}}</tool_call>'
    "{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined and m.tool_call_id %} (result of {{ m.tool_call_id }}){% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: ids 0-2 are <pad>, <s>, </s>, then the 256 bytes.

    It has a chat template (:data:`CHAT_TEMPLATE`, with tools), so chats, tool calls and
    ``acb serve`` work on the embedded model as on a real checkpoint.

    Returns:
        A ``PreTrainedTokenizerFast`` of 259 tokens (no download).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
