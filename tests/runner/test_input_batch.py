"""Staging bookkeeping (CPU twin of the pinned, double-buffered GPU path) and the device block table."""

from __future__ import annotations

import numpy as np
import torch

from acb.core.messages import SchedulerOutput
from acb.runner.input_batch import DeviceStreams, InputBatch, StagingRing

CPU = torch.device("cpu")


def test_two_sets_alternate_and_do_not_alias():
    ring = StagingRing(64, CPU, DeviceStreams(CPU))
    views = []
    for step in range(3):
        st = ring.begin()
        assert st.index == step % 2
        st.add("ids", np.arange(5, dtype=np.int64) + 100 * step)
        st.add("p", np.full((2, 3), step + 0.5, dtype=np.float32))
        st.add("flag", np.array([step % 2 == 0, True]))
        views.append(st.send())
        if step == 1:  # step 0's inputs are still intact while step 1 is staged (the in-flight step)
            assert views[0]["ids"].tolist() == [0, 1, 2, 3, 4]
            assert torch.equal(views[0]["p"], torch.full((2, 3), 0.5))
    assert views[2]["ids"].tolist() == [200, 201, 202, 203, 204]
    assert views[2]["p"].dtype == torch.float32 and views[2]["flag"].dtype == torch.bool
    assert views[2]["flag"].tolist() == [True, True]
    assert views[1]["ids"].tolist() == [100, 101, 102, 103, 104]  # set 1 untouched by step 2
    assert [s.uses for s in ring.sets] == [2, 1]


def test_staging_grows_for_a_large_step():
    ring = StagingRing(32, CPU, DeviceStreams(CPU))
    st = ring.begin()
    big = np.arange(1000, dtype=np.int64)
    st.add("a", big)
    st.add("b", np.arange(3, dtype=np.float32))
    dev = st.send()
    assert st.capacity >= 8 * 1000 + 16
    assert torch.equal(dev["a"], torch.from_numpy(big))
    assert dev["b"].tolist() == [0.0, 1.0, 2.0]


def _sched(rows, num_new, start, updates, ids=None):
    n = sum(num_new)
    return SchedulerOutput(
        step_id=0,
        requests=[None] * len(rows),
        rows=rows,
        num_new=num_new,
        start_pos=start,
        input_ids=ids or list(range(3, 3 + n)),
        sample_idx=list(range(len(rows))),
        sample_reqs=[],
        sample_rows=rows,
        sample_gen_idx=[0] * len(rows),
        block_updates=updates,
        newly_admitted=[],
        row_inits=[],
        freed_rows=[],
        block_copies_after=[],
        swap_out=[],
        swap_in=[],
    )


def test_device_block_table_mirrors_the_host_and_slots_follow_it():
    bs = 4
    ib = InputBatch(max_rows=4, max_blocks_per_seq=8, block_size=bs, device=CPU)
    ring = StagingRing(256, CPU, DeviceStreams(CPU))
    # row 2: a 6-token prompt in blocks 7, 3; row 0: a 1-token prompt in block 5
    s1 = _sched([2, 0], [6, 1], [0, 0], [(2, 0, [7, 3]), (0, 0, [5])])
    st = ring.begin()
    host = ib.stage(s1, st)
    b = ib.build(host, st.send(), torch.zeros(0, dtype=torch.long))
    assert torch.equal(ib.block_table_dev, torch.from_numpy(ib.block_table))
    assert b.attn.block_table.tolist() == [[7, 3], [5, 0]]
    assert b.attn.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 20]
    assert b.logits_indices.tolist() == [5, 6] and not b.decode_only
    assert ib.block_table[ib.scratch_row].sum() == 0
    # decode step: row 2 grows into block 9 at column 2 (position 8), row 0 at position 1;
    # its ids are placeholders taken from the previous step's samples (on the device)
    s2 = _sched([2, 0], [1, 1], [8, 1], [(2, 2, [9])], ids=[-1, -1])
    s2.placeholders = [(0, 1), (1, 0)]
    st = ring.begin()
    host = ib.stage(s2, st)
    b = ib.build(host, st.send(), torch.tensor([40, 41]))
    assert b.decode_only and b.input_ids.tolist() == [[41, 40]]
    assert b.attn.slot_mapping.tolist() == [36, 21]
    assert b.attn.block_table.tolist() == [[7, 3, 9], [5, 0, 0]]
    assert torch.equal(ib.block_table_dev, torch.from_numpy(ib.block_table))


def test_decode_fast_path_stages_what_the_general_path_stages(monkeypatch):
    """Issue 54 item 5: a decode-only step's arrays (no cumsum or repeat) and the staging set's
    reused device views give the same inputs as the general path, step after step, as rows join,
    leave, cross into new blocks, sample out of order and take placeholders."""
    from acb.runner import input_batch

    steps = [
        _sched([0, 1, 2], [1, 1, 1], [4, 9, 2], [(1, 2, [11])]),
        _sched([0, 1, 2], [1, 1, 1], [5, 10, 3], [], ids=[-1, 8, -1]),
        _sched([2, 0], [1, 1], [4, 6], [(2, 1, [6])]),  # row 1 left
        _sched([2, 0, 3], [1, 1, 1], [5, 7, 0], [(3, 0, [12])]),  # row 3 joined (its first token)
        _sched([3, 0, 2], [1, 1, 1], [1, 8, 6], [(0, 2, [13])]),  # same size, other order
    ]
    steps[1].placeholders = [(0, 1), (2, 0)]
    steps[4].sample_idx = [2, 0]  # not the identity: logits rows 2, 0
    steps[4].sample_rows = [2, 3]

    def run(reuse: bool) -> list[dict[str, object]]:
        monkeypatch.setattr(input_batch, "REUSE", reuse)
        ib = InputBatch(max_rows=4, max_blocks_per_seq=4, block_size=4, device=CPU)
        for row, blocks in ((0, [1, 2]), (1, [3, 4]), (2, [5])):
            ib.block_table[row, : len(blocks)] = blocks
            ib.block_table_dev[row, : len(blocks)] = torch.tensor(blocks)
        ring = StagingRing(256, CPU, DeviceStreams(CPU))
        prev = torch.tensor([50, 51, 52])
        seen = []
        for s in steps * 2:  # twice: the second round reuses every layout's views
            st = ring.begin()
            host = ib.stage(s, st)
            b = ib.build(host, st.send(), prev)
            seen.append(
                dict(
                    ids=b.input_ids.tolist(),
                    pos=b.position_ids.tolist(),
                    logits=b.logits_indices.tolist(),
                    identity=b.logits_identity,
                    decode=b.decode_only,
                    rows=b.rows.tolist(),
                    slots=b.attn.slot_mapping.tolist(),
                    table=b.attn.block_table.tolist(),
                    lens=b.attn.seq_lens.tolist(),
                    qsl=b.attn.query_start_loc.tolist(),
                    max_len=b.attn.max_seq_len,
                    dev_table=ib.block_table_dev.tolist(),
                )
            )
        return seen

    fast, general = run(True), run(False)
    assert fast == general
    assert fast[1]["ids"] == [[51, 8, 50]] and fast[4]["logits"] == [2, 0] and not fast[4]["identity"]
