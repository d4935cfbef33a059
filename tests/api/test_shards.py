"""``checkpoint.pieces.assemble``: any target span of a table, put together from saved shards of any
layout (row blocks, residues, column slices) and deltas, equals slicing the whole table; only
the files that overlap the target are read."""

from __future__ import annotations

import random

import torch

from hybridembed.checkpoint.pieces import Target, _progression, assemble, files_for

ROWS, DIM = 37, 6


def _layout(kind: str, k: int) -> list[tuple[int, int, int, int, int]]:
    """Spans (row_start, row_end, row_step, col_start, col_end) of ``k`` shards of one kind."""
    if kind == "blocks":
        cuts = sorted(random.sample(range(1, ROWS), k - 1)) if k > 1 else []
        edges = [0, *cuts, ROWS]
        return [(a, b, 1, 0, DIM) for a, b in zip(edges, edges[1:])]
    if kind == "residues":
        return [(r, ROWS, k, 0, DIM) for r in range(k)]
    cuts = sorted(random.sample(range(1, DIM), min(k, DIM) - 1))
    edges = [0, *cuts, DIM]
    return [(0, ROWS, 1, a, b) for a, b in zip(edges, edges[1:])]


def _save(tmp_path, name: str, whole: torch.Tensor, state: torch.Tensor, spans) -> dict:
    shards = []
    for i, (a, b, s, c0, c1) in enumerate(spans):
        rel = f"{name}.{i}.pt"
        torch.save(
            {"weight": whole[a:b:s, c0:c1].clone(), "state": {"sum": state[a:b:s, c0:c1].clone()}}, tmp_path / rel
        )
        shards.append({"file": rel, "row_start": a, "row_end": b, "row_step": s, "col_start": c0, "col_end": c1})
    return {"kind": "dense", "shape": [ROWS, DIM], "shards": shards}


def test_progression_is_the_rows_both_ranges_hold():
    for a in [(0, 30, 1), (3, 30, 4), (2, 25, 3), (5, 6, 1)]:
        for b in [(0, 30, 2), (1, 30, 3), (7, 19, 1), (29, 30, 5)]:
            both = sorted(set(range(*a)) & set(range(*b)))
            hit = _progression(a, b)
            if not both:
                assert hit is None
                continue
            d0, ds, s0, ss, n = hit
            rows_a = list(range(*a))[d0 : d0 + (n - 1) * ds + 1 : ds]
            rows_b = list(range(*b))[s0 : s0 + (n - 1) * ss + 1 : ss]
            assert rows_a == rows_b == both


def test_any_target_of_any_saved_layout_equals_slicing_the_whole_table(tmp_path):
    random.seed(0)
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        whole = torch.randn(ROWS, DIM, generator=g)
        state = torch.rand(ROWS, DIM, generator=g)
        saved = _save(
            tmp_path,
            f"t{trial}",
            whole,
            state,
            _layout(random.choice(["blocks", "residues", "cols"]), random.randint(1, 4)),
        )
        versions = [(tmp_path, saved)]
        if trial % 2:  # a delta on top: some rows changed, saved in another layout
            changed = torch.tensor(sorted(random.sample(range(ROWS), 9)))
            whole[changed] = torch.randn(9, DIM, generator=g)
            state[changed] = torch.rand(9, DIM, generator=g)
            shards = []
            for i, (a, b, s, c0, c1) in enumerate(_layout(random.choice(["blocks", "residues", "cols"]), 3)):
                mine = changed[(changed >= a) & (changed < b) & ((changed - a) % s == 0)]
                rel = f"d{trial}.{i}.pt"
                obj = {"rows": mine, "weight": whole[mine, c0:c1].clone(), "state": {"sum": state[mine, c0:c1].clone()}}
                torch.save(obj, tmp_path / rel)
                shards.append(
                    {
                        "file": rel,
                        "row_start": a,
                        "row_end": b,
                        "row_step": s,
                        "col_start": c0,
                        "col_end": c1,
                        "changed": len(mine),
                    }
                )
            versions.append((tmp_path, {"kind": "dense", "shape": [ROWS, DIM], "shards": shards}))
        for a, b, s, c0, c1 in _layout(random.choice(["blocks", "residues", "cols"]), random.randint(1, 4)):
            target = Target((a, b, s), (c0, c1))
            entry, problems = assemble("t", versions, target, DIM, False, ["sum"])
            assert problems == []
            assert torch.equal(entry["weight"], whole[a:b:s, c0:c1]), (trial, a, b, s, c0, c1)
            assert torch.equal(entry["state"]["sum"], state[a:b:s, c0:c1])


def test_only_the_files_that_overlap_the_target_are_read(tmp_path):
    whole, state = torch.randn(ROWS, DIM), torch.rand(ROWS, DIM)
    saved = _save(tmp_path, "b", whole, state, [(0, 10, 1, 0, DIM), (10, 20, 1, 0, DIM), (20, ROWS, 1, 0, DIM)])
    read = []

    def load(vdir, rel):
        read.append(rel)
        return torch.load(vdir / rel, mmap=True, weights_only=True)

    target = Target((12, 18, 1), (0, DIM))
    assert files_for([(tmp_path, saved)], target, DIM, False) == [(tmp_path, "b.1.pt")]
    entry, _ = assemble("t", [(tmp_path, saved)], target, DIM, False, [], load)
    assert read == ["b.1.pt"] and torch.equal(entry["weight"], whole[12:18])


def test_a_file_that_does_not_hold_its_rows_is_a_problem_not_a_crash(tmp_path):
    whole, state = torch.randn(ROWS, DIM), torch.rand(ROWS, DIM)
    saved = _save(tmp_path, "c", whole, state, [(0, ROWS, 1, 0, DIM)])
    torch.save({"weight": whole[:-1]}, tmp_path / "c.0.pt")
    entry, problems = assemble("t", [(tmp_path, saved)], Target((0, ROWS, 1), (0, DIM)), DIM, False, ["sum"])
    assert entry == {} and "'c.0.pt' does not hold 'weight' of shape (37, 6) (got (36, 6))" in problems[0]


def test_dynamic_shards_must_tile_columns_and_hash_residues():
    from hybridembed.checkpoint.manifest import _check_shards

    def table(*shards):
        return {"kind": "dynamic", "shape": [None, 4], "shards": [{"file": f"{i}", **s} for i, s in enumerate(shards)]}

    hashed = [{"residue": 0, "residues": 2}, {"residue": 1, "residues": 2}]
    assert _check_shards("t", table(*hashed)) == []
    assert "residues [0, 0], not 0..k-1 once" in _check_shards("t", table(hashed[0], hashed[0]))[0]
    assert _check_shards("t", table({"col_end": 2}, {"col_start": 2})) == []
    assert "do not tile 0..4" in _check_shards("t", table({"col_end": 2}, {"col_start": 3}))[0]
