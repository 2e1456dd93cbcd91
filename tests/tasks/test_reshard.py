"""A run resumed at another data-parallel size continues its data streams (``Task.reshard_state``).

math_jsonl: the saved epoch goes on over the new shards (no row served twice, at most ``k_new - 1`` rows of
the epoch skipped, the rest served), and later epochs are the uninterrupted run's permutations. Arithmetic
(and any task on the base class): the prompt stream is re-seeded from (seed, step), not restarted, so the
first prompts after the resume are not the run's opening prompts.
"""

from __future__ import annotations

import json
import math

import pytest

from nemo_fp8rl.tasks import get_task, reshard_seed

N = 23  # odd, and not a multiple of 2 or 3: every layout leaves rows out of an epoch


def _data(tmp_path, n=N):
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"row {i}?", "answer": i}) for i in range(n)) + "\n")
    return str(p)


def _ranks(path, k, seed=3):
    """The tasks of a k-rank run as the trainer builds them (task_kwargs): per-rank seed, shared shuffle seed."""
    base = seed * 1000 + 29
    if k == 1:
        return [get_task("math_jsonl", path=path, seed=base)]
    return [get_task("math_jsonl", path=path, seed=base + r, shard_rank=r, num_shards=k, shuffle_seed=base)
            for r in range(k)]


def _row(p) -> int:
    return int(p.text.split()[1].rstrip("?"))


@pytest.mark.parametrize(("k_old", "k_new", "per_step"), [(1, 2, 3), (2, 1, 2), (2, 3, 2), (3, 2, 1)])
def test_math_jsonl_reshard_continues_the_epoch(tmp_path, k_old, k_new, per_step):
    path = _data(tmp_path)
    old = _ranks(path, k_old)
    steps = 2
    served = [_row(p) for _ in range(steps) for t in old for p in t.prompts(per_step)]
    saved = [t.state_dict() for t in old]
    assert len(set(served)) == len(served)  # (one epoch so far)

    # the uninterrupted run: its permutations of the next epochs
    ref = _ranks(path, k_old)
    for t, st in zip(ref, saved):
        t.load_state_dict(st)

    new = _ranks(path, k_new)
    notes = [t.reshard_state(saved, r, k_new, step=steps) for r, t in enumerate(new)]
    assert all("epoch 0 continued" in s for s in notes), notes
    # the rest of epoch 0: every new rank to the end of its shard
    rest = [[_row(p) for p in t.prompts(len(t.order) - t.cursor)] for t in new]
    flat = [x for r in rest for x in r]
    assert len(set(flat)) == len(flat), "a row served twice across the new ranks"
    assert not set(flat) & set(served), "a row served before the resume came again"
    # left out of epoch 0: the seam (positions len(served) .. k_new * new cursor, at most k_new - 1 rows)
    # and the N % k_new rows every epoch of k_new shards leaves out
    seam = k_new * math.ceil(len(served) / k_new) - len(served)
    assert seam <= k_new - 1
    assert N - len(served) - len(flat) == seam + N % k_new, notes
    assert f"{seam} rows of the epoch skipped" in notes[0]
    assert all(t.epoch == 0 and t.cursor == len(t.order) for t in new)

    # next epoch: the uninterrupted run's permutation, over the new shards
    for t in ref:
        t.prompts(len(t.order) - t.cursor)  # finish epoch 0
    nxt_new = [[_row(p) for p in t.prompts(len(t.order))] for t in new]
    nxt_ref = [[_row(p) for p in t.prompts(len(t.order))] for t in ref]
    assert all(t.epoch == 1 for t in new + ref)
    perm_ref = [nxt_ref[j % k_old][j // k_old] for j in range(k_old * len(nxt_ref[0]))]
    perm_new = [nxt_new[j % k_new][j // k_new] for j in range(k_new * len(nxt_new[0]))]
    m = min(len(perm_ref), len(perm_new))
    assert perm_new[:m] == perm_ref[:m]
    assert sorted(set(perm_new)) == sorted(perm_new)


def test_math_jsonl_reshard_dp1_to_dp2_by_hand(tmp_path):
    """The docstring's rule on one case: DP1 served 5 rows; new rank r of 2 starts at ceil(5 / 2) = 3."""
    path = _data(tmp_path)
    (one,) = _ranks(path, 1)
    first = [_row(p) for p in one.prompts(5)]
    perm = list(one.order)
    assert first == perm[:5]
    new = _ranks(path, 2)
    for r, t in enumerate(new):
        t.reshard_state([one.state_dict()], r, 2, step=5)
        assert (t.epoch, t.cursor) == (0, 3)
        assert t.order == perm[:22][r::2]  # 23 rows: an epoch of 2 shards serves 22
    # position 5 (perm[5], rank 1's stride at cursor 2) is the one skipped row at the seam
    assert [_row(p) for p in new[0].prompts(1)] == [perm[6]]
    assert [_row(p) for p in new[1].prompts(1)] == [perm[7]]


def test_math_jsonl_reshard_with_unequal_cursors_and_epochs(tmp_path):
    """DAPO dynamic sampling: ranks at different cursors (or epochs) continue from the furthest one,
    skipping rows a slower rank had not reached, never serving one twice."""
    path = _data(tmp_path, 12)
    old = _ranks(path, 2)  # 6 rows per rank and epoch
    served = [_row(p) for p in old[0].prompts(4)] + [_row(p) for p in old[1].prompts(2)]
    new = _ranks(path, 3)
    note = new[0].reshard_state([t.state_dict() for t in old], 0, 3, step=4)
    for r in (1, 2):
        new[r].reshard_state([t.state_dict() for t in old], r, 3, step=4)
    # from position 2 * max(4, 2) = 8; new cursor ceil(8 / 3) = 3: positions 5, 7 (rank 1 had not reached
    # them) and 8 (the seam) are skipped
    assert "position 8" in note and "6 rows served" in note and "3 rows of the epoch skipped" in note, note
    rest = [_row(p) for t in new for p in t.prompts(len(t.order) - t.cursor)]
    assert not set(rest) & set(served) and len(rest) == len(set(rest)) == 12 - 9

    # rank 0 already in epoch 1 (2 rows of it), rank 1 still in epoch 0 at cursor 3
    old = _ranks(path, 2)
    ref = _ranks(path, 2)
    old[0].prompts(6 + 2)
    old[1].prompts(3)
    for t in ref:  # the uninterrupted run's epoch-1 permutation
        t.prompts(6)
    e1 = [[_row(p) for p in t.prompts(6)] for t in ref]
    perm1 = [e1[j % 2][j // 2] for j in range(12)]
    new = _ranks(path, 1)
    note = new[0].reshard_state([t.state_dict() for t in old], 0, 1, step=7)
    assert "epoch 1 continued from position 4" in note and "3 rows of earlier epochs" in note, note
    assert new[0].order == perm1 and new[0].cursor == 4
    # the permutation generator continues: epoch 2 equals the uninterrupted run's
    e2 = [[_row(p) for p in t.prompts(6)] for t in ref]
    new[0].prompts(8)
    assert [_row(p) for p in new[0].prompts(12)] == [e2[j % 2][j // 2] for j in range(12)]


def test_math_jsonl_reshard_refuses_inconsistent_states(tmp_path):
    path = _data(tmp_path)
    old = _ranks(path, 2)
    for t in old:
        t.prompts(2)
    states = [t.state_dict() for t in old]
    new = _ranks(path, 3)
    with pytest.raises(ValueError, match="pass one state per saved DP rank, in rank order"):
        new[0].reshard_state(states[::-1], 0, 3, step=2)
    with pytest.raises(ValueError, match="rows but .* now has 12 usable rows; resume with the same data file"):
        _ranks(_write12(tmp_path), 3)[0].reshard_state(states, 0, 3, step=2)
    other = [get_task("math_jsonl", path=path, seed=9, shard_rank=r, num_shards=2, shuffle_seed=99) for r in range(2)]
    for t in other:
        t.prompts(2)
    mixed = [states[0], other[1].state_dict()]
    with pytest.raises(ValueError, match="resume with the saved data-parallel size"):
        new[0].reshard_state(mixed, 0, 3, step=2)
    with pytest.raises(ValueError, match="build the task with shard_rank=dp_rank"):
        new[0].reshard_state(states, 1, 3, step=2)


def _write12(tmp_path):
    d = tmp_path / "twelve"
    d.mkdir(exist_ok=True)
    return _data(d, 12)


def test_arithmetic_reshard_does_not_restart_the_prompt_stream():
    seed = 3 * 1000 + 29  # DP rank 0's task seed in the trainer
    run = get_task("arithmetic", digits=3, seed=seed)
    opening = [p.text for p in run.prompts(8)]
    run.prompts(8)
    saved = [run.state_dict()]
    new = [get_task("arithmetic", digits=3, seed=seed + r) for r in range(2)]
    notes = [t.reshard_state(saved, r, 2, step=2) for r, t in enumerate(new)]
    assert "re-seeded from (seed 3029, step 2)" in notes[0], notes
    after = [[p.text for p in t.prompts(8)] for t in new]
    assert after[0] != opening and after[1] != opening and after[0] != after[1]
    # as built (the bug): DP rank 0 would have replayed the opening prompts
    assert [p.text for p in get_task("arithmetic", digits=3, seed=seed).prompts(8)] == opening
    # deterministic: the same resume gives the same stream; another step another one
    again = get_task("arithmetic", digits=3, seed=seed)
    again.reshard_state(saved, 0, 2, step=2)
    assert [p.text for p in again.prompts(8)] == after[0]
    later = get_task("arithmetic", digits=3, seed=seed)
    later.reshard_state(saved, 0, 2, step=3)
    assert [p.text for p in later.prompts(8)] != after[0]
    assert all(t.prompts_served == 16 + 8 for t in new)  # counts on from the saved rank
    fresh = get_task("arithmetic", digits=3, seed=seed)
    fresh.generator.manual_seed(reshard_seed(seed, 2))
    assert [p.text for p in fresh.prompts(8)] == after[0]  # the seed is reshard_seed(seed as built, step)
    with pytest.raises(KeyError, match="saved data-parallel rank 0 is missing"):
        get_task("arithmetic").reshard_state([{"prompts_served": 1}], 0, 2, step=1)
