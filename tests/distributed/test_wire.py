"""``wire="bf16"``: pooled rows and their gradients cross the exchange as bfloat16 (half the bytes),
each element rounded once, against the exact wire of the same job."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table
from hybridembed.launch import spawn

TABLES = [he.TableConfig("tw", 40, 8), he.TableConfig("cw", 30, 8), he.TableConfig("rw", 50, 8)]


def _plan(world: int) -> Plan:
    ranks = tuple(range(world))
    return Plan(
        world,
        (
            shard_table(TABLES[0], "table_wise", (1,)),
            shard_table(TABLES[1], "column_wise", ranks),
            shard_table(TABLES[2], "row_wise", ranks),
        ),
    )


def _job(rank: int, world: int, wire: str | None) -> dict:
    """Two SGD steps of every table (rank 0 asks for rows rank 1 owns and the other way round);
    what crossed in the rows' all-to-alls (dtype, elements, through gloo or shared memory), the
    outputs, the trained tables."""
    from hybridembed.distributed import shm

    ec = ShardedCollection(TABLES, plan=_plan(world), seed=5, wire=wire)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.5), ec)
    sent: list[tuple[torch.dtype, int, str]] = []
    real, real_shared = dist.all_to_all_single, shm.Transport.all_to_all

    def counting(out, t, *a, **k):
        if t.is_floating_point():
            sent.append((t.dtype, t.numel(), "gloo"))
        return real(out, t, *a, **k)

    def counting_shared(tr, out, t, *a, **k):
        pieces = [t] if isinstance(t, torch.Tensor) else [x for p in t for x in p]
        if pieces and pieces[0].is_floating_point():
            sent.append((pieces[0].dtype, sum(x.numel() for x in pieces), "shared"))
        return real_shared(tr, out, t, *a, **k)

    initial = ec.gather_table("rw")
    dist.all_to_all_single, shm.Transport.all_to_all = counting, counting_shared
    outs = []
    try:
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + rank)
            batch = {
                t.name: he.Jagged.from_lists(
                    [torch.randint(0, t.num_embeddings, (n,), generator=g).tolist() for n in (1, 3, 2, 0, 4)]
                )
                for t in TABLES
            }
            out = ec(batch)
            outs.append({k: v.detach().clone() for k, v in out.items()})
            opt.zero_grad()
            sum((v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in out.values()).backward()
            opt.step()
    finally:
        dist.all_to_all_single, shm.Transport.all_to_all = real, real_shared
    return {"sent": sent, "outs": outs, "initial": initial, "tables": {t.name: ec.gather_table(t.name) for t in TABLES}}


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def test_bf16_wire_rounds_what_crosses_once_and_halves_its_bytes():
    exact = spawn(_job, 2, None, timeout=120)
    bf16 = spawn(_job, 2, "bf16", timeout=120)
    for ex, bf in zip(exact, bf16):
        rows_ex = [(d, n) for d, n, _ in ex["sent"] if n > 8]  # (the rows' all-to-alls, forward and backward)
        rows_bf = [(d, n) for d, n, _ in bf["sent"] if n > 8]
        assert rows_ex and all(d == torch.float32 for d, _ in rows_ex)
        assert [n for _, n in rows_bf] == [n for _, n in rows_ex] and all(d == torch.bfloat16 for d, _ in rows_bf)
        # step 1: the same tables on both; a table-wise table's output is the owner's pooled row rounded
        # once, a column-wise table's the slices each rounded; row blocks: partial bags summed here
        first_ex, first_bf = ex["outs"][0], bf["outs"][0]
        torch.testing.assert_close(first_bf["tw"], _bf16(first_ex["tw"]), rtol=0, atol=0)
        torch.testing.assert_close(first_bf["cw"], _bf16(first_ex["cw"]), rtol=0, atol=0)
        bound = 2**-8 * 4 * ex["initial"].abs().max()  # (each partial, at most 4 rows, rounded once)
        assert ((first_bf["rw"] - first_ex["rw"]).abs() <= bound).all()
        assert not torch.equal(first_bf["rw"], first_ex["rw"])
        for name in ("tw", "cw", "rw"):  # trained by rounded gradients: close to exact, not equal
            got, want = bf["tables"][name], ex["tables"][name]
            assert not torch.equal(got, want), name
            torch.testing.assert_close(got, want, rtol=0, atol=0.5 * 2 * 2**-8 * 4, msg=name)


def _job_through(rank: int, world: int, shared: bool) -> dict:
    """:func:`_job` with either wire, every rows' exchange large enough for shared memory, allowed
    or not (one job: the choice is read when each collection's first large exchange runs)."""
    import os

    from hybridembed.distributed import runtime, shm

    runtime.FOLD_ROWS = 0
    os.environ[shm.ENV] = "1" if shared else "0"
    return {str(wire): _job(rank, world, wire) for wire in (None, "bf16")}


def test_rows_through_shared_memory_equal_gloos_bit_for_bit():
    gloo = spawn(_job_through, 2, False, timeout=120)
    shared = spawn(_job_through, 2, True, timeout=120)
    for g_wires, s_wires in zip(gloo, shared):
        for wire, g in g_wires.items():
            s = s_wires[wire]
            rows_g, rows_s = [w for _, n, w in g["sent"] if n > 8], [w for _, n, w in s["sent"] if n > 8]
            assert rows_g and set(rows_g) == {"gloo"} and len(rows_s) == len(rows_g) and set(rows_s) == {"shared"}
            for a, b in zip(g["outs"], s["outs"]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), wire
            assert all(torch.equal(g["tables"][k], s["tables"][k]) for k in g["tables"]), wire


def _refused(rank: int, world: int) -> list[str]:
    out = []
    for kw in ({"wire": "fp8"}, {"wire": torch.bfloat16}, {"wire": "bf16", "servers": 1}):
        model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4))
        try:
            he.distribute(model, **kw)
        except he.ConfigError as e:
            out.append(str(e))
    return out


def test_a_wire_other_than_bf16_and_bf16_with_servers_are_refused_on_every_rank():
    got = spawn(_refused, 2, timeout=120)
    for msgs in got:
        assert len(msgs) == 3, msgs
        assert "wire must be None" in msgs[0] and "'fp8'" in msgs[0]
        assert "wire must be None" in msgs[1]
        assert "parameter servers" in msgs[2]
    with pytest.raises(he.ConfigError, match="wire must be"):
        he.distribute(torch.nn.EmbeddingBag(10, 4), wire="half")
