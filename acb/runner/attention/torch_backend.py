"""The reference attention backend: gather each sequence's pages and run SDPA.

Decode rows (one query token) are sorted by context length and split into a few groups whose
lengths are close, so that padding to a group's longest context wastes little; each group is
one SDPA call per layer. Prefill chunks run one SDPA call each. Causal masks are aligned
bottom-right (a chunk's queries sit at the end of its context). Masks, groups and gather
indices are built once per step and shared by all layers.

The pages are gathered whole (``index_select`` over the block dimension: one contiguous copy
per page) into a workspace the backend keeps between steps. A fresh tensor per gather costs
more than the copy itself on CPU: allocations this large come from the OS, zeroed page by
page, every time. A decode group is gathered and attended a few MB of K/V at a time
(``CHUNK_BYTES``), which SDPA then reads from cache rather than from memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from acb.runner.attention import AttentionCall, BatchInputs, StepContext
from acb.runner.indexed import allowed_keys

if TYPE_CHECKING:
    from collections.abc import Callable

    from acb.runner.latent import LatentExpand
    from acb.runner.media import MediaBlocks

# a decode row starts a new group when its pages are fewer than this share of the group's
# longest row's (so a group pads at most ~1/0.7 of its real context), up to MAX_GROUPS groups
GROUP_RATIO = 0.7
MAX_GROUPS = 6
# a decode group's rows are gathered and attended this many bytes of K and V at a time: a whole
# group's (tens of MB) is out of the CPU's cache by the time SDPA reads it back, a chunk's is not
# (1.8x faster for 128 rows of 256 tokens on a 32 MiB L3)
CHUNK_BYTES = 8 << 20


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    ctx_len: int  # keys visible to the last query (= start + q_len)
    blocks: torch.Tensor | None  # [ceil(ctx_len / block_size)] its pages; None when the chunk is the whole context


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [G] token index of each query
    blocks: torch.Tensor  # [G * num_blocks] the rows' pages, row-major (a shorter row's tail: whatever its
    # block-table row holds there, valid page ids whose keys the mask hides)
    seq_lens: torch.Tensor  # [G]
    num_blocks: int  # pages per row (the group's longest)


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    num_tokens: int
    block_size: int
    prefills: list[_Prefill]
    decode_rows: int  # rows of one query token (the decode rows)
    _masks: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    # prefill segments whose image tokens attend to their whole image on some layers (Gemma 3's
    # every layer, Gemma 4's sliding ones): each context position's image block, and those layers
    # (acb.runner.media)
    media_groups: MediaBlocks | None = None
    # the CPU backend's decode rows for its kernel: the block table, and each row's batch index,
    # token index and context length (acb.runner.attention.cpu_backend)
    kernel_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the CPU backend's prefill chunks whose queries its kernel takes (short chunks after a cached
    # prefix), out of ``prefills``; the torch path runs them where the kernel cannot
    kernel_prefills: list[_Prefill] = field(default_factory=list)
    # the decode rows' groups (:attr:`decode`), or what builds them on first read: a backend that
    # may not need them (the CPU backend's kernel takes its decode rows) leaves them to then
    groups: list[_DecodeGroup] | None = None
    build_groups: Callable[[], list[_DecodeGroup]] | None = None

    @property
    def decode(self) -> list[_DecodeGroup]:
        """The decode rows' groups (the torch path's padded SDPA calls), longest rows first."""
        if self.groups is None:
            assert self.build_groups is not None  # one of the two is set
            self.groups, self.build_groups = self.build_groups(), None
        return self.groups


def absorbs_chunk(latent: LatentExpand, n: int) -> bool:
    """Whether a chunk of ``n`` queries after a cached prefix attends an MLA layer's latent absorbed
    (B3) rather than expanded (B1). Per key, B1 expands the latent into the heads (``H * r * (nope +
    v)`` multiply-adds) and B3 attends it once per query and head (``n * H * 2 * (r + rope)``): B3 while
    that is the smaller (one decode row always; chunks of up to 25 queries for the benchmark's shape,
    113 for DeepSeek V3's)."""
    return latent.absorbs and n * 2 * (latent.rank + latent.rope) <= latent.rank * (latent.nope + latent.v_dim)


def decode_groups(lengths: list[int], block_size: int) -> list[list[int]]:
    """Indices into ``lengths`` (context lengths of decode rows), longest first, split where a
    row's page count falls below ``GROUP_RATIO`` of its group's first (at most ``MAX_GROUPS``)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    top = 0
    for i in order:
        nb = -(-lengths[i] // block_size)
        if not groups or (nb < GROUP_RATIO * top and len(groups) < MAX_GROUPS):
            groups.append([])
            top = nb
        groups[-1].append(i)
    return groups


def decode_groups_of(batch: BatchInputs, block_size: int, dec: list[int], qsl: list[int]) -> list[_DecodeGroup]:
    """The decode rows' groups (:func:`decode_groups`): ``dec`` the rows of one query token,
    ``qsl`` the host copy of ``query_start_loc``."""
    device = batch.slot_mapping.device
    groups = []
    for members in decode_groups([batch.start_pos[i] + 1 for i in dec], block_size):
        rows = [dec[j] for j in members]
        nb = -(-(batch.start_pos[rows[0]] + 1) // block_size)
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        groups.append(
            _DecodeGroup(
                rows=torch.tensor([qsl[i] for i in rows], dtype=torch.long, device=device),
                blocks=batch.block_table[idx, :nb].reshape(-1),
                seq_lens=batch.seq_lens[idx],
                num_blocks=nb,
            )
        )
    return groups


class TorchBackend:
    name = "torch"
    features = frozenset({"sinks", "chunk", "index", "latent"})
    supports_graphs = False  # gathers are sized from host lengths

    def __init__(self) -> None:
        # ("k" | "v", *page shape): gathered pages, reused across steps
        self._workspace: dict[tuple[Any, ...], torch.Tensor] = {}

    def build_metadata(self, batch: BatchInputs, block_size: int) -> TorchMetadata:
        qsl = [0]  # host copy of query_start_loc (no device read)
        for n in batch.num_new:
            qsl.append(qsl[-1] + n)
        dec = [i for i, n in enumerate(batch.num_new) if n == 1]
        prefills = []
        for i, n in enumerate(batch.num_new):
            if n == 1:
                continue
            start = batch.start_pos[i]
            ctx_len = start + n
            blocks = batch.block_table[i, : -(-ctx_len // block_size)] if start > 0 else None
            prefills.append(_Prefill(qsl[i], n, ctx_len, blocks))
        return TorchMetadata(
            slot_mapping=batch.slot_mapping,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            num_tokens=batch.slot_mapping.numel(),
            block_size=block_size,
            prefills=prefills,
            decode_rows=len(dec),
            groups=decode_groups_of(batch, block_size, dec, qsl),
        )

    def release(self) -> int:
        """Drop the workspace (engine sleep); returns its bytes. The next gather allocates it again."""
        freed = sum(t.nbytes for t in self._workspace.values())
        self._workspace.clear()
        return freed

    def _gather(self, pages: torch.Tensor, blocks: torch.Tensor, which: str) -> torch.Tensor:
        """``pages[blocks]`` (``[n, block_size, Hkv, D]``) into the workspace."""
        n = blocks.numel()
        # one workspace per page shape: layers of different shapes (Gemma 4) take turns, and one
        # shared buffer would be reallocated, larger each time, at every change of shape
        key = (which, *pages.shape[1:])
        ws = self._workspace.get(key)
        if (
            ws is None
            or ws.shape[0] < n
            or ws.shape[1:] != pages.shape[1:]
            or ws.dtype != pages.dtype
            or ws.device != pages.device
        ):
            ws = torch.empty(
                (max(n, 3 * (ws.shape[0] if ws is not None else 0) // 2), *pages.shape[1:]),
                dtype=pages.dtype,
                device=pages.device,
            )
            self._workspace[key] = ws
        return torch.index_select(pages, 0, blocks, out=ws[:n])

    # masks ----------------------------------------------------------------
    def _decode_mask(self, md: TorchMetadata, g: int, window: int | None, chunk: int | None) -> torch.Tensor:
        key = ("d", g, window, chunk)
        m = md._masks.get(key)
        if m is None:
            group = md.decode[g]
            pos = torch.arange(group.num_blocks * md.block_size, device=group.seq_lens.device)[None, :]
            lens = group.seq_lens[:, None]
            m = pos < lens
            if window is not None:
                m &= pos > (lens - 1 - window)
            if chunk is not None:  # the query (position lens - 1) sees its own chunk only
                m &= pos >= (lens - 1) // chunk * chunk
            m = m[:, None, None, :]  # [G, 1, 1, L]
            md._masks[key] = m
        return m

    def _prefill_mask(
        self, md: TorchMetadata, k: int, p: _Prefill, window: int | None, chunk: int | None, media_blocks: bool
    ) -> torch.Tensor | None:
        groups = md.media_groups.segments.get(p.q_start) if media_blocks and md.media_groups is not None else None
        if p.blocks is None and window is None and chunk is None and groups is None:
            return None  # plain causal over the chunk: SDPA's is_causal
        key = ("p", k, window, chunk, groups is not None)
        m = md._masks.get(key)
        if m is None:
            device = md.slot_mapping.device
            qpos = torch.arange(p.ctx_len - p.q_len, p.ctx_len, device=device)[:, None]
            kpos = torch.arange(p.ctx_len, device=device)[None, :]
            m = kpos <= qpos
            if groups is not None:  # an image's tokens also see its later ones (the window still applies)
                gq = groups[p.ctx_len - p.q_len :][:, None]
                m |= (gq == groups[None, :]) & (gq >= 0)
            if window is not None:
                m &= kpos > qpos - window
            if chunk is not None:
                m &= kpos >= qpos // chunk * chunk
            md._masks[key] = m
        return m

    # forward --------------------------------------------------------------
    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D] (an MLA latent layer: the step's latent [1, 1, T, r + rope])
        value: torch.Tensor,
        ctx: StepContext,
        call: AttentionCall,
    ) -> torch.Tensor:
        md: TorchMetadata = ctx.metadata
        cache = ctx.kv_cache
        k_pages, v_pages = cache.k[layer], cache.v[layer]  # [num_blocks, block_size, Hkv, D]
        latent = call.latent
        if call.store:
            k_flat = cache.flat_k(layer)
            k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
            k_flat.index_copy_(0, md.slot_mapping, k_new.to(k_flat.dtype))
            if latent is None:
                v_flat = cache.flat_v(layer)
                v_new = value[0].transpose(0, 1)
                v_flat.index_copy_(0, md.slot_mapping, v_new.to(v_flat.dtype))

        q = query[0]  # [H, T, D]
        v_dim = q.shape[2] if latent is None else latent.v_dim
        out = query.new_empty(md.num_tokens, q.shape[0], v_dim)  # [T, H, Dv]
        media_blocks = md.media_groups is not None and md.media_groups.on(cache, layer)
        la = replace(call, media_blocks=True) if media_blocks else call
        if la.index is not None and getattr(self, "fixed_order", False):
            # the batch-invariant mode: each query's selected keys in position order through acb's CPU
            # kernel (acb.runner.batch_invariant_dsa), not a mask over SDPA's blocked sums
            from acb.runner import batch_invariant_dsa

            if batch_invariant_dsa.FIXED_ATTENTION:
                batch_invariant_dsa.paged_indexed_attention(md, q, k_pages, v_pages, out, la)
            else:  # (the tests' off switch: this backend's masked SDPA, every chunk and decode row)
                TorchBackend._decode(self, md, q, k_pages, v_pages, out, la)
                for j, p in enumerate([*md.prefills, *md.kernel_prefills]):
                    self._prefill(md, j, p, q, key, value, k_pages, v_pages, out, la)
            return out.unsqueeze(0)
        if md.decode_rows or md.kernel_prefills:
            self._decode(md, q, k_pages, v_pages, out, la)
        for k, p in enumerate(md.prefills):
            self._prefill(md, k, p, q, key, value, k_pages, v_pages, out, la)
        return out.unsqueeze(0)  # [1, T, H, D]

    def _prefill(
        self,
        md: TorchMetadata,
        k: int,  # the chunk's number (its mask's key)
        p: _Prefill,
        q: torch.Tensor,  # [H, T, D]
        key: torch.Tensor | None,  # [1, Hkv, T, D] (read for a chunk with no cached prefix only)
        value: torch.Tensor | None,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        out: torch.Tensor,  # [T, H, D]: the chunk's rows are written
        la: AttentionCall,
    ) -> None:
        """One prefill chunk: its cached prefix gathered (if any), then SDPA, causal bottom-right."""
        hkv, d = k_pages.shape[2], k_pages.shape[3]
        s, n = p.q_start, p.q_len
        if la.latent is not None and p.blocks is not None and absorbs_chunk(la.latent, n):
            self._prefill_absorbed(md, k, p, q, k_pages, out, la)
            return
        qp = q[:, s : s + n, :].unsqueeze(0)  # [1, H, n, D]
        if la.latent is not None:  # the request's latent, expanded by the module's own code (as generate)
            if p.blocks is None:
                assert key is not None
                lat = key[:, :, s : s + n, :]
            else:
                lat = self._gather(k_pages, p.blocks, "k").view(-1, hkv, d)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
            kp, vp = _same_width(*la.latent(lat))
        elif p.blocks is None:
            assert key is not None and value is not None
            kp = key[:, :, s : s + n, :]
            vp = value[:, :, s : s + n, :]
        else:
            kp = self._gather(k_pages, p.blocks, "k").view(-1, hkv, d)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
            vp = self._gather(v_pages, p.blocks, "v").view(-1, hkv, d)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
        mask = self._prefill_mask(md, k, p, la.sliding_window, la.chunk, la.media_blocks)
        if la.index is not None:  # indexed attention: of the causal keys, those the indexer selected
            if mask is None:
                mask = torch.ones(n, p.ctx_len, dtype=torch.bool, device=q.device).tril(p.ctx_len - n)
            mask = mask & allowed_keys(la.index, slice(s, s + n), p.ctx_len)
        o = _attend(qp, kp, vp, mask, mask is None, la.scaling, la.softcap, la.sinks)
        out[s : s + n] = o[0].transpose(0, 1)[..., : out.shape[2]]  # (a latent's values padded: cropped)

    def _prefill_absorbed(
        self,
        md: TorchMetadata,
        k: int,
        p: _Prefill,
        q: torch.Tensor,  # [H, T, nope + rope]
        k_pages: torch.Tensor,  # [num_blocks, block_size, 1, r + rope]: the latent
        out: torch.Tensor,  # [T, H, v_dim]
        la: AttentionCall,
    ) -> None:
        """A short chunk after a cached prefix over an MLA layer's latent pages, absorbed (B3): as
        :meth:`_decode_absorbed`, the chunk's ``n`` queries of ``H`` heads as ``n * H`` query rows of
        the one latent head, each row masked as its query."""
        lat = la.latent
        assert lat is not None and p.blocks is not None
        d = k_pages.shape[3]
        s, n = p.q_start, p.q_len
        h = q.shape[0]
        scale = la.scaling if la.scaling is not None else q.shape[2] ** -0.5
        qa = lat.absorb_query(q[:, s : s + n, :]).transpose(0, 1).reshape(1, 1, n * h, d)  # query-major rows
        kp = self._gather(k_pages, p.blocks, "k").view(1, -1, 1, d)[:, : p.ctx_len].transpose(1, 2)  # [1, 1, L, d]
        mask = self._prefill_mask(md, k, p, la.sliding_window, la.chunk, la.media_blocks)
        assert mask is not None  # a cached prefix: the mask is always built
        if la.index is not None:
            mask = mask & allowed_keys(la.index, slice(s, s + n), p.ctx_len)
        sinks = None if la.sinks is None else la.sinks.repeat(n).view(1, 1, -1, 1)  # each row's head's
        o = _attend(qa, kp, kp, mask.repeat_interleave(h, dim=0), False, scale, la.softcap, sinks)  # [1, 1, n * H, d]
        out[s : s + n] = lat.unabsorb(o.view(n, h, d))

    def _decode(
        self,
        md: TorchMetadata,
        q: torch.Tensor,  # [H, T, D]
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        out: torch.Tensor,  # [T, H, D]: the decode rows' are written
        la: AttentionCall,
    ) -> None:
        """The decode rows: each group's pages gathered, then SDPA with a length mask."""
        if la.latent is not None and absorbs_chunk(la.latent, 1):
            self._decode_absorbed(md, q, k_pages, out, la)
            return
        hkv, d = k_pages.shape[2], k_pages.shape[3]
        for g, group in enumerate(md.decode):
            length = group.num_blocks * md.block_size
            dmask = self._decode_mask(md, g, la.sliding_window, la.chunk)
            # a chunk of rows at a time, so that its gathered K/V is still in cache when SDPA reads it
            width = 2 * hkv * d if la.latent is None else la.latent.heads * (q.shape[2] + la.latent.v_dim)
            rows_per = max(1, CHUNK_BYTES // (length * width * k_pages.element_size()))
            for a in range(0, group.rows.numel(), rows_per):
                rows = group.rows[a : a + rows_per]
                blocks = group.blocks[a * group.num_blocks : (a + rows_per) * group.num_blocks]
                qd = q[:, rows, :].transpose(0, 1).unsqueeze(2)  # [G, H, 1, D]
                kd = self._gather(k_pages, blocks, "k").view(-1, length, hkv, d).transpose(1, 2)  # [G, Hkv, L, D]
                if la.latent is not None:  # the rows' latent [G, 1, L, r + rope] expanded into their K/V
                    kd, vd = _same_width(*la.latent(kd))
                else:
                    vd = self._gather(v_pages, blocks, "v").view(-1, length, hkv, d).transpose(1, 2)
                rmask = dmask[a : a + rows_per]
                if la.index is not None:  # indexed attention: the keys the indexer selected, of those
                    rmask = rmask & allowed_keys(la.index, rows, length)[:, None, None, :]
                o = _attend(qd, kd, vd, rmask, False, la.scaling, la.softcap, la.sinks)
                out[rows] = o[:, :, 0, : out.shape[2]]

    def _decode_absorbed(
        self,
        md: TorchMetadata,
        q: torch.Tensor,  # [H, T, nope + rope]
        k_pages: torch.Tensor,  # [num_blocks, block_size, 1, r + rope]: the latent
        out: torch.Tensor,  # [T, H, v_dim]: the decode rows' are written
        la: AttentionCall,
    ) -> None:
        """An MLA layer's decode rows over its latent pages, absorbed (B3 of ``acb.runner.latent``):
        the rows' queries ``[q_nope . W_UK | q_rot]`` attend over the one latent head as keys and
        values, the heads folded into the query length (one SDPA call attends them all, no head
        expanded), and the output's first ``r`` columns times ``W_UV^T`` are the heads' values."""
        lat = la.latent
        assert lat is not None
        d = k_pages.shape[3]
        scale = la.scaling if la.scaling is not None else q.shape[2] ** -0.5  # the model's, of nope + rope
        sinks = None if la.sinks is None else la.sinks.view(1, 1, -1, 1)  # a query row is a head here
        for g, group in enumerate(md.decode):
            length = group.num_blocks * md.block_size
            dmask = self._decode_mask(md, g, la.sliding_window, la.chunk)
            qa = lat.absorb_query(q[:, group.rows, :]).transpose(0, 1).unsqueeze(1)  # [G, 1, H, r + rope]
            oa = qa.new_empty(qa.shape)
            rows_per = max(1, CHUNK_BYTES // (length * d * k_pages.element_size()))
            for a in range(0, group.rows.numel(), rows_per):
                blocks = group.blocks[a * group.num_blocks : (a + rows_per) * group.num_blocks]
                kd = self._gather(k_pages, blocks, "k").view(-1, length, 1, d).transpose(1, 2)  # [g, 1, L, r + rope]
                rmask = dmask[a : a + rows_per]  # [g, 1, 1, L]: the same keys for every head of a row
                if la.index is not None:  # indexed attention: the keys the indexer selected, of those
                    rmask = rmask & allowed_keys(la.index, group.rows[a : a + rows_per], length)[:, None, None, :]
                oa[a : a + rows_per] = _attend(qa[a : a + rows_per], kd, kd, rmask, False, scale, la.softcap, sinks)
            out[group.rows] = lat.unabsorb(oa[:, 0])


def _same_width(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expanded MLA latent's K (``nope + rope`` wide) and V (``v_dim``), V zero-padded to K's width
    as the expanded cache stores it (its extra output columns are zeros, dropped): SDPA with one head
    width takes its fused kernels, with two its math path (7x slower for a 1,024-token CPU prefill)."""
    if v.shape[-1] < k.shape[-1]:
        v = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
    return k, v


def _attend(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, True = attend; broadcastable to [B, H, Lq, Lk]
    causal: bool,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [H] sink logits: one more softmax column per head, whose value is 0
    # (or [1, 1, Lq, 1]: per query row, where an MLA latent's heads are folded into the query length)
) -> torch.Tensor:
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
    # logit soft-capping (Gemma 2) and attention sinks (GPT-OSS) are not expressible in SDPA:
    # explicit attention, as transformers' eager
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    if sinks is None:
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)
    # GPT-OSS's eager: softmax over [scores, sink] (max subtracted), the sink's column dropped
    sink = (sinks.reshape(1, -1, 1, 1) if sinks.dim() == 1 else sinks).to(w.dtype).expand(*w.shape[:3], 1)
    w = torch.cat([w, sink], dim=-1)
    w = w - w.max(dim=-1, keepdim=True).values
    w = torch.softmax(w, dim=-1, dtype=w.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(w, v)
