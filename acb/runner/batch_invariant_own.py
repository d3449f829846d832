"""The batch-invariant mode on the second runner path (models on their own cache objects:
:mod:`acb.runner.own_cache_runner`); the mode itself is :mod:`acb.runner.batch_invariant`.

How the path is made batch-invariant: in the mode the runner prefills each prompt whole, in one
call (no chunked prefill, hence no prefix caching; a recompute replays the prompt, then a token a
call), with the mode's ops on (:func:`acb.runner.batch_invariant.engine_step`: the fixed linear,
the element-wise ops' fixed path) and the language model's attention set to the mode's
transformers attention function (:data:`acb.runner.batch_invariant.ATTN_IMPL_NAME`: acb's
fixed-order kernel over each row's keys from its first real one), as
:func:`acb.runner.batch_invariant.enabled` sets it for a trainer (:func:`mode_forward`). Its rows
run in the path's batched forms (whole prompts as left-padded prefill groups, decode rows stacked
in one left-padded batch cache) where the start-up try :func:`batched_rows_differ` finds each row
of them bit for bit what it gives alone (``OwnCacheRunner.mode_rows == "batched"``); else (the
path does not batch the model: no position ids, its own generation hooks, a cache of other layers,
state in its modules; or the try found a row changed) each request's forwards run alone, as
``model.generate`` runs one unpadded prompt (``mode_rows == "alone"``, the reason logged). What
shares a request's steps then changes none of its rows' bits, so (a) a request's bits are the same
alone and among others, at small step budgets, through preemptions and async scheduling; and (b) a
trainer's forward over the whole sequence under ``enabled(model)`` computes each token's logprob
exactly as the engine's one-token call did, when every op of the model computes a token's row by
the same arithmetic however many tokens the call holds.

(b) is what decides which models are covered (:func:`own_cache_refusal`), by two checks on the
model at engine start, not by a list of families:

1. **Every product is one of the mode's fixed forms.** A short forward under the mode, watched by
   a ``TorchFunctionMode``: a matrix product that sums over a dimension (``matmul``/``@``, ``bmm``,
   ``baddbmm``, ``mm``, ``addmm``, ``einsum`` with a summed index, SDPA...) run by the model's own
   code, not through ``F.linear`` (the fixed linear) or transformers' attention interface (the
   fixed attention), is refused, naming the module and the op: BLOOM's ``baddbmm``, GPT-J's and
   GPT-Neo's ``matmul`` (their attention does not go through transformers' attention interface),
   GPT-1's ``Conv1D`` (``addmm``), xLSTM's chunked scan. MKL computes such a product's rows by
   kernels and blockings chosen by the shapes, so a one-token call and a whole sequence give a
   token other bits (a tiny model's shapes may happen to agree; a real one's do not).
2. **The whole sequence and a token a call give the same bits.** The model's own ``generate``
   (its prompt in one call, then a token a call on its own cache, under the mode) and one forward
   over the same tokens must give every generated position's logits bit for bit: what a model's
   own code does across positions (a recurrent scan whose whole-sequence form differs from its
   one-token form, a reduction over the sequence, positions it derives from the cache) shows
   here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from acb.runner import batch_invariant as bi

# products that sum over a dimension: the model's own code must not compute one in the mode
_PRODUCTS: dict[Any, str] = {}


def _products() -> dict[Any, str]:
    if not _PRODUCTS:
        t, f = torch.Tensor, torch.nn.functional
        for fn, name in (
            (torch.matmul, "torch.matmul"),
            (t.matmul, "Tensor.matmul"),
            (t.__matmul__, "@"),
            (t.__rmatmul__, "@"),
            (torch.bmm, "torch.bmm"),
            (t.bmm, "Tensor.bmm"),
            (torch.baddbmm, "torch.baddbmm"),
            (t.baddbmm, "Tensor.baddbmm"),
            (torch.mm, "torch.mm"),
            (t.mm, "Tensor.mm"),
            (torch.addmm, "torch.addmm"),
            (t.addmm, "Tensor.addmm"),
            (torch.addbmm, "torch.addbmm"),
            (torch.einsum, "torch.einsum"),
            (torch.tensordot, "torch.tensordot"),
            (f.scaled_dot_product_attention, "F.scaled_dot_product_attention"),
        ):
            _PRODUCTS[fn] = name
    return _PRODUCTS


def _summed(name: str, args: tuple[Any, ...]) -> bool:
    """Whether the product sums over a dimension of more than one element (an outer product, or
    rotary's ``inv_freq @ positions`` with its one-element inner dimension, sums nothing)."""
    if name == "torch.einsum":
        eq = args[0] if args and isinstance(args[0], str) else ""
        if "->" not in eq:
            return True
        ins, out = eq.replace(" ", "").split("->")
        return bool(set(ins.replace(",", "")) - set(out) - {"."})
    if name == "F.scaled_dot_product_attention":
        return True
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # (addmm/baddbmm: input, a, b; the rest: a, b) the first factor's last dimension is the sum's
    a = tensors[-2] if len(tensors) >= 2 else None
    return a is None or a.dim() == 0 or a.shape[-1] > 1


class _Watch(torch.overrides.TorchFunctionMode):
    """Records the first product the model's own code computes (module class, op)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.found: tuple[str, str] | None = None
        self.attention_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _products().get(func)
        if name is not None and self.found is None and _summed(name, tuple(args)):
            self.found = (self.stack[-1] if self.stack else "the model", name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _watched(model: torch.nn.Module) -> Iterator[_Watch]:
    """A :class:`_Watch` over ``model``'s forwards, which knows the innermost module running."""
    stack: list[str] = []
    handles = []

    def enter(mod: torch.nn.Module, args: Any) -> None:
        stack.append(type(mod).__name__)

    def leave(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    watch = _Watch(stack)
    original = bi.attention_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        watch.attention_calls += 1
        return original(*args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(bi.ATTN_IMPL_NAME, counted)
    try:
        with watch:
            yield watch
    finally:
        bi.register_with_transformers()  # (the uncounted function back)
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _eval(model: torch.nn.Module) -> Iterator[None]:
    """The start-up tries in eval semantics (dropout off), each module's flag put back after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in flags:
            m.training = was


def _tokens(model: Any, n: int) -> torch.Tensor:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    return torch.randint(min(16, vocab - 1), vocab, (1, n), generator=g).to(device)


def product_outside_fixed_forms(model: torch.nn.Module) -> str | None:
    """Check 1 (module docstring): None when a short forward of ``model`` under the mode computes
    no product outside the mode's fixed linear and attention, else which and where."""
    with _eval(model), torch.no_grad(), bi.enabled(model), _watched(model) as watch:
        model(input_ids=_tokens(model, 12))
    if watch.found is None:
        return None
    where, op = watch.found
    if watch.attention_calls == 0 and "attention" in where.lower():
        return (
            f"its attention does not go through transformers' attention interface ({where} computes {op} "
            "itself, whose bits for a token move with the number of tokens in the call)"
        )
    return (
        f"{where} computes {op} itself, outside the mode's fixed linear and attention (its bits for a "
        "token move with the number of tokens in the call)"
    )


def _window(model: Any) -> int:
    """The widest window the language model's config names (``sliding_window``, ``attention_window``,
    ...; 0: none): the check's prompt goes past it, where a cache that keeps only the window and a
    whole-sequence forward may part."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    sizes = [0]
    for key, value in vars(cfg).items():
        if "window" in key:
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    sizes.append(v)
    return max(sizes)


def whole_and_stepwise_differ(model: Any, prompt: int | None = None, new: int = 6) -> str | None:
    """Check 2 (module docstring): None when, under the mode, the model's own ``generate`` (the
    prompt in one call, then a token a call) and one forward over the same tokens give every
    generated position's logits bit for bit, else how they differ. The prompt (by default 9
    tokens) reaches past the widest window the config names."""
    if prompt is None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        room = getattr(cfg, "max_position_embeddings", None)
        prompt = max(9, _window(model) + 4)
        if isinstance(room, int) and room > new + 9:
            prompt = min(prompt, room - new - 1)
    ids = _tokens(model, prompt)
    with _eval(model), torch.no_grad(), bi.enabled(model):
        try:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        except Exception as exc:  # noqa: BLE001 - the reason names it
            return f"its own generate failed under the mode ({type(exc).__name__}: {exc})"
        seq = out.sequences
        steps = torch.stack([lg[0] for lg in out.logits])  # [new, V]: the prompt's last, then each token's
        whole = model(input_ids=seq[:, :-1]).logits[0, prompt - 1 :]
    if whole.shape != steps.shape or not torch.equal(whole.float(), steps.float()):
        diff = (whole.float() - steps.float()).abs().max().item() if whole.shape == steps.shape else float("nan")
        return (
            "its whole-sequence forward and its one-token form (a prompt, then a token a call on its own cache) "
            f"give other bits under the mode (max |Δ logit| {diff:.2e}): the model's own code computes a token "
            "differently in the two forms (a recurrent scan, a reduction over the sequence, a window its cache "
            "keeps that its whole-sequence forward does not)"
        )
    return None


def own_cache_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run ``model`` on its own cache objects (None: it can): the two start-up
    checks of the module docstring (a product outside the mode's fixed forms; the whole sequence
    and a token a call giving other bits). On CUDA (the Triton forms) the path is not built yet."""
    p = next(model.parameters(), None)
    if (p is not None and p.is_cuda) or bi.KERNEL:
        return (
            "on CUDA, models on their own cache objects (runner='own_cache'): the mode's path there is CPU-checked only"
        )
    bi.register_with_transformers()
    from acb.runner.batch_invariant_products import install

    install(model)  # (a model whose attention is its own code: its products by the fixed forms)
    for check in (product_outside_fixed_forms, whole_and_stepwise_differ):
        try:
            problem = check(model)
        except Exception as exc:  # noqa: BLE001 - a forward the checks cannot run: refused, with why
            problem = f"its forward failed under the mode's start-up check ({type(exc).__name__}: {exc})"
        if problem is not None:
            return f"on its own cache objects (runner='own_cache'), {problem}"
    return None


# the start-up try of the batched forms (:func:`batched_rows_differ`): per step, the requests that
# run (name, tokens: a whole prompt, or 1: a decode token), and the requests that finish before it
_SCRIPT: list[tuple[list[str], list[tuple[str, int]]]] = [
    ([], [("a", 4), ("b", 11), ("c", 13)]),  # a prefill group (padding 9, 2, 0 columns)
    ([], [("a", 1), ("b", 1), ("c", 1)]),  # the group's rows as stacked decode rows
    ([], [("a", 1), ("b", 1), ("c", 1)]),
    (["a"], [("b", 1), ("c", 1), ("d", 21)]),  # a leaves; d's lone prompt joins the batch wider (padding grows)
    ([], [("b", 1), ("c", 1), ("d", 1)]),
    ([], [("c", 1), ("d", 1), ("e", 7), ("f", 30)]),  # b not scheduled (out, on its own cache); a group of 7 and 30
    ([], [("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)]),  # b joins back from its own cache, e and f join
    ([], [("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)]),
    (["c", "d"], [("b", 1), ("e", 1), ("f", 1)]),  # rows leave from the middle (the last moves in; padding trimmed)
    ([], [("f", 1), ("b", 1), ("e", 1)]),  # another order in the step
    (["b", "e"], [("f", 1)]),  # a lone decode row: its own cache, taken out of the batch (padding dropped)
]


def batched_rows_differ(runner: Any) -> str | None:
    """The start-up try of the mode's batched forms on the own-cache path (None: each row exact).

    The runner (:class:`acb.runner.own_cache_runner.OwnCacheRunner`, in the mode) plays
    :data:`_SCRIPT` twice through its own step (``runner.forward``, under the mode), on scratch
    rows: once in its batched forms (whole prompts as left-padded prefill groups, decode rows
    stacked in the decode batch), once one row a call; every wanted logits row of every step must
    be the same bits. The script covers what moves a row's place in the batch between its steps:
    left padding of several widths in a prefill group and in the decode batch, a lone prompt
    joining the decode batch wider than its rows (everyone's padding grows), a row leaving the
    batch (not scheduled: on its own cache) and joining back, rows finishing from the middle (the
    last row moves into their places, padding no row needs is trimmed), batches of 2 to 5 rows in
    other orders, and a row decoding alone on the cache taken out of the batch. With that, nothing left in a later step can differ: the mode's linear computes
    each row alone (its bits do not depend on the other rows nor on how many there are, which
    the one-row-a-call form relies on already: a prompt's rows count its tokens), its attention
    reads each row's padding from the mask and runs over the row's keys from its first real one
    (the padding's width does not enter the sum), and a row's positions are its own; a model that
    keeps a request's state in its modules is never batched. What a short try can miss is model
    code that mixes rows only past some size (a mixture of experts that drops tokens over a
    capacity: none of the covered families does): any op that mixes rows at all shows here, as
    the try runs batches of two to five rows.
    """
    model = runner.model
    tokens = _tokens(model, 64)
    offsets = {name: 5 * i for i, name in enumerate("abcdef")}

    def play(base: int) -> list[torch.Tensor]:
        ids_of = {name: base - i for i, name in enumerate("abcdef")}
        used: dict[str, int] = {}
        outs = []
        try:
            for done, step in _SCRIPT:
                for name in done:
                    runner.reset(ids_of[name])
                rows, lens, parts = [], [], []
                for name, n in step:
                    at, lo = used.get(name, 0), offsets[name]
                    rows.append(ids_of[name])
                    lens.append(n)
                    parts.append(tokens[:, lo + at : lo + at + n])
                    used[name] = at + n
                ids = torch.cat(parts, dim=1)
                pos = torch.cat([torch.arange(used[name] - n, used[name], device=ids.device) for name, n in step])[None]
                ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
                outs.append(runner.forward(ids, pos, lens, rows, ends))
        finally:
            for row in ids_of.values():
                runner.reset(row)
        return outs

    with _eval(model), torch.no_grad():
        try:
            batched = play(-40)
            runner.batchable = False
            alone = play(-50)
        except Exception as exc:  # noqa: BLE001 - the reason names it
            return f"its batched forms failed under the mode's start-up try ({type(exc).__name__}: {exc})"
        finally:
            runner.batchable = True
    for i, (x, y) in enumerate(zip(batched, alone)):
        if x.shape != y.shape or not torch.equal(x, y):
            diff = (x - y).abs().max().item() if x.shape == y.shape else float("nan")
            return (
                f"a row in the batched forms (left-padded prefill groups, stacked decode rows) gave other bits than "
                f"alone at step {i + 1} of the start-up try (max |Δ logit| {diff:.2e}): the model's code mixes rows "
                "or follows their padding otherwise than the mode's fixed forms"
            )
    return None


@contextlib.contextmanager
def mode_forward(model: Any) -> Iterator[None]:
    """The engine's forwards on the own-cache path in the mode (the engine thread): the mode's
    ops (:func:`acb.runner.batch_invariant.engine_step`) and the language model's attention set to
    :data:`acb.runner.batch_invariant.ATTN_IMPL_NAME` for the block, its own back after, as
    :func:`acb.runner.batch_invariant.enabled` sets it for a trainer (the text config's
    implementation, written directly: ``set_attn_implementation`` checks and logs at every step)."""
    from acb.runner.batch_invariant_products import needs_fixed_products

    p = next(model.parameters())
    if needs_fixed_products(model):  # its attention is its own code (its products: the fixed forms'),
        # which would read the mode's boolean mask as its own float one
        with bi.engine_step(p.is_cuda):
            yield
        return
    bi.register_with_transformers()
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    own = getattr(text, "_attn_implementation_internal", None)
    text._attn_implementation_internal = bi.ATTN_IMPL_NAME
    try:
        with bi.engine_step(p.is_cuda):
            yield
    finally:
        text._attn_implementation_internal = own
