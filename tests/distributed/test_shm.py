"""The rows' all-to-all through shared memory (``hybridembed.distributed.shm``) delivers what gloo's
``all_to_all_single`` delivers, call after call, through growing, shrinking and empty calls, every
dtype the wire carries, and leaves no file behind; it is refused where ranks cannot share memory."""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist

from hybridembed.distributed import shm
from hybridembed.launch import spawn

# per call, the elements rank s sends rank d: SIZES[call][s][d] (world 3)
SIZES = [
    [[5, 7, 0], [3, 3, 3], [1, 0, 9]],
    [[300_000, 7, 1], [3, 200_000, 3], [1, 0, 9]],  # grows past the first files
    [[4, 7, 0], [3, 2, 3], [1, 0, 10]],  # shrinks: the grown files are kept
    [[0, 0, 0], [0, 0, 0], [0, 0, 0]],  # nothing at all
    [[900_000, 1, 900_000], [2, 2, 2], [700_000, 700_000, 1]],  # grows again, both parities
    [[6, 6, 6], [6, 6, 6], [6, 6, 6]],
]
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.float32]


def _data(call: int, src: int, dst: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + 10 * src + dst)
    return (torch.randn(n, generator=g) * 100).to(dtype)


def _calls(rank: int, world: int, full_at: int | None = None) -> dict:
    """Every call of SIZES through a transport against gloo's all-to-all; ``full_at``: from that call
    on, rank 0 cannot make a file (its /dev/shm full: at call 4 it grows one)."""
    group = dist.group.WORLD
    t = shm.Transport.open(group, torch.device("cpu"))
    assert t is not None
    real, statuses, broken = shm._map, [], []
    for call, (sizes, dtype) in enumerate(zip(SIZES, DTYPES)):
        if full_at is not None and call == full_at and rank == 0:

            def full(path, nbytes, create):
                if create:
                    raise OSError(28, "No space left on device", path)
                return real(path, nbytes, create)

            shm._map = full
        send_splits = sizes[rank]
        recv_splits = [sizes[s][rank] for s in range(world)]
        pieces = [_data(call, rank, d, n, dtype) for d, n in enumerate(send_splits)]
        send = torch.cat(pieces)
        ref = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(ref, send, recv_splits, send_splits)
        if call % 2:  # received into one matrix per source (flat pieces sent)
            out = [[send.new_full((n // 2, 2) if n % 2 == 0 else (n,), 7)] for n in recv_splits]
            statuses.append(t.all_to_all(out, send, recv_splits, send_splits, status=float(rank + call)))
            out = torch.cat([m.reshape(-1) for p in out for m in p])
        else:  # sent from strided matrices, received flat
            mats = []
            for p in pieces:  # (each an (n, 1) view of every other element of a buffer)
                buf = torch.zeros(p.numel(), 2, dtype=p.dtype)
                buf[:, 0] = p
                mats.append(buf[:, :1])
            out = send.new_full((sum(recv_splits),), 7)
            statuses.append(t.all_to_all(out, [[m] for m in mats], recv_splits, send_splits, status=float(rank + call)))
        assert torch.equal(out, ref), (call, rank)
        expected = torch.cat([_data(call, s, rank, sizes[s][rank], dtype) for s in range(world)])
        assert torch.equal(out, expected), (call, rank)
        broken.append(t.broken)
    every = t.all_gather([torch.full((rank,), float(rank))])  # (a gather after them: through gloo too once given up)
    assert [e[0].tolist() for e in every] == [[float(q)] * q for q in range(world)]
    shm._map = real
    prefix = t.prefixes[rank]
    t.close()
    dist.barrier()
    left = [n for n in os.listdir(shm.DIR) if n.startswith(prefix)]
    return {"statuses": statuses, "left": left, "broken": broken}


@pytest.mark.skipif(not os.access(shm.DIR, os.W_OK), reason="no writable /dev/shm")
@pytest.mark.parametrize("full_at", [None, 4], ids=["shared", "dev-shm-full-on-one-rank"])
def test_the_shared_memory_all_to_all_equals_gloos_and_leaves_no_file(full_at):
    res = spawn(_calls, 3, full_at, timeout=120)
    for r in res:
        assert r["statuses"] == [[float(s + c) for s in range(3)] for c in range(len(SIZES))]
        assert r["left"] == []
        # a rank that cannot grow its file: every rank goes through gloo from that call on
        assert r["broken"] == [full_at is not None and c >= full_at for c in range(len(SIZES))]


# per call, the rows each rank gathers (world 3): every rank's (ids, rows) pieces
GATHERS = [[3, 0, 5], [200_000, 7, 90_000], [0, 0, 0], [4, 1, 2], [500_000, 3, 600_000], [2, 2, 2]]


def _piece(call: int, rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * call + rank)
    return [torch.randint(-(2**40), 2**40, (n,), generator=g), torch.randn(n, 3, generator=g, dtype=torch.float64)]


def _gathers(rank: int, world: int, full_at: int | None) -> dict:
    """Gathers of every rank's pieces (ints and (n, 3) rows, some ranks or every rank none, growing
    the files past their first size) read where they lie; ``full_at``: rank 0 cannot make a file from
    that call on (every rank goes through gloo from there)."""
    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    # (every rank's names carry its PID and start time: each peer is seen to run, its files swept by name)
    assert all(shm._runs(p) and shm._NAME.fullmatch(f"{p}-0-1-1") for p in t.prefixes), t.prefixes
    real, broken, ok = shm._map, [], []
    for call, sizes in enumerate(GATHERS):
        if full_at is not None and call == full_at and rank == 0:
            shm._map = lambda path, nbytes, create: (_ for _ in ()).throw(OSError(28, "No space", path))
        mine = _piece(call, rank, sizes[rank])
        mine[1] = mine[1][:, :3]  # (a piece may be any strided tensor)
        got = t.all_gather(mine)
        if (
            call == 1 and full_at is None
        ):  # a forked child that ends (a data loader's worker) leaves this rank's files alone
            names = list(t._unlink)  # (the files this call grew: their names stay until the next meeting)
            assert names
            pid = os.fork()
            if pid == 0:
                t.close()
                os._exit(0)
            os.waitpid(pid, 0)
            assert all(os.path.exists(n) for n in names), names
        ok.append(all(
            len(got[q]) == 2 and all(torch.equal(a, b) for a, b in zip(got[q], _piece(call, q, sizes[q])))
            for q in range(world)
        ))  # fmt: skip
        broken.append(t.broken)
    shm._map = real
    prefix = t.prefixes[rank]
    t.close()
    dist.barrier()
    return {"ok": ok, "broken": broken, "left": [n for n in os.listdir(shm.DIR) if n.startswith(prefix)]}


@pytest.mark.skipif(not os.access(shm.DIR, os.W_OK), reason="no writable /dev/shm")
@pytest.mark.parametrize("full_at", [None, 4], ids=["shared", "dev-shm-full-on-one-rank"])
def test_the_shared_memory_gather_gives_every_rank_s_pieces(full_at):
    for r in spawn(_gathers, 3, full_at, timeout=120):
        assert r["ok"] == [True] * len(GATHERS)
        assert r["broken"] == [full_at is not None and c >= full_at for c in range(len(GATHERS))]
        assert r["left"] == []


def _mismatched(rank: int, world: int) -> str:
    """Ranks that gather pieces of different widths: each rank's read of the other's is refused."""
    from hybridembed.errors import HybridEmbedError

    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    try:
        t.all_gather([torch.arange(4), torch.zeros(5, 3 if rank == 0 else 4)])
    except HybridEmbedError as e:
        return str(e)
    finally:
        t.close()
    return "gathered"


def test_pieces_that_differ_between_ranks_are_refused_on_every_rank():
    for rank, msg in enumerate(spawn(_mismatched, 2, timeout=60)):
        assert f"rank {1 - rank}'s pieces in the shared-memory gather are not this rank's" in msg, msg


def _late(peer, *args):
    time.sleep(0.5)
    return peer(*args)


def _ends_first(rank: int, world: int) -> list:
    """Rank 0 closes its transport (its job ends) right after a call whose new files rank 1 maps
    late: rank 1 still reads them (rank 0 waited for it before removing their names)."""
    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    got = []
    for call, n in enumerate((10, 400_000)):  # (the second grows the files: new names)
        if rank == 1 and call == 1:
            t._peer = functools.partial(_late, t._peer)
        got.append(t.all_gather([torch.full((n,), float(rank))])[1 - rank][0].sum().item())
        if rank == 0 and call == 1:
            t.close()
    t.close()
    return got


def test_a_rank_that_ends_first_leaves_its_last_files_to_a_late_peer():
    assert spawn(_ends_first, 2, timeout=60) == [[10.0, 400_000.0], [0.0, 0.0]]


def test_a_closing_rank_waits_for_a_peer_that_runs_and_not_for_one_that_is_gone(tmp_path):
    """Its last call's files: kept while a running peer has not mapped them (up to the wait), removed
    at once when the peer's process is gone (ended, not yet collected by its parent)."""
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    time.sleep(0.1)  # (a zombie until waited for)
    for peer, wait, least, most in ((os.getpid(), 0.5, 0.5, 5.0), (gone, 10.0, 0.0, 2.0)):
        name = tmp_path / f"last-{peer}"
        name.write_bytes(b"x")
        control = [torch.full((shm._control_bytes(2) // 8,), -1, dtype=torch.int64) for _ in range(2)]
        t = shm.Transport(None, 0, 2, [f"hybridembed-{os.getpid()}-aa", f"hybridembed-{peer}-bb"], control)
        t.calls, t._unlink = 1, [str(name)]
        start = time.monotonic()
        t.close(wait=wait)
        assert least <= time.monotonic() - start < most and not name.exists(), peer
    os.waitpid(gone, 0)


def _meetings(rank: int, world: int, futex: str) -> dict:
    """Meetings one after another, a different rank late to each, a rank's shared memory failed in
    one, the meetings' count wrapping past its 31 bits: what each rank learns of the others."""
    os.environ[shm.ENV + "_FUTEX"] = futex
    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    t._meets = 0x7FFFFFFF - 3  # (the next meetings count 0x7FFFFFFD, 0x7FFFFFFE, 0x7FFFFFFF, 0, 1, ...)
    got = []
    for k in range(8):
        if rank == k % world:
            time.sleep(0.05)
        got.append(t._meet(float(10 * k + rank), k == 5 and rank == 1))
    t.close()
    return {"rings": t.rings, "got": got}


@pytest.mark.parametrize("futex", ["1", "0"], ids=["control-files", "gloo"])
def test_a_meeting_gives_every_rank_every_status_whoever_comes_last(futex):
    for r in spawn(_meetings, 3, futex, timeout=60):
        assert r["rings"] == (futex == "1" and shm._FUTEX.works)
        assert r["got"] == [([10.0 * k + q for q in range(3)], [1] if k == 5 else []) for k in range(8)]


def _futex_on_one_rank(rank: int, world: int) -> bool:
    os.environ[shm.ENV + "_FUTEX"] = (
        "0" if rank == 1 else "1"
    )  # (one rank turned the futex off: every rank meets by gloo)
    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    try:
        return t.rings
    finally:
        t.close()


def test_a_rank_that_turns_the_futex_off_turns_it_off_for_every_rank():
    assert spawn(_futex_on_one_rank, 2, timeout=60) == [False, False]


def _failing_meanwhile(rank: int, world: int) -> list:
    """A call whose ``meanwhile`` raises on rank 0 (after its pieces are written): the call still
    completes on every rank (the meeting, the peers' pieces copied), rank 0 raises after it, and
    the next calls go on (the first call grows the files: their names are kept until mapped)."""
    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    got = []
    for call, n in enumerate((300_000, 5, 300_000)):
        send = torch.full((2 * n,), float(10 * call + rank))
        out = torch.zeros(2 * n)

        def boom(call=call):
            if rank == 0 and call == 0:
                raise ValueError("boom")

        try:
            t.all_to_all(out, send, [n, n], [n, n], meanwhile=boom)
            got.append(out[n * (1 - rank) : n * (2 - rank)].unique().tolist())
        except ValueError as e:
            got.append(str(e))
    t.close()
    return got


def test_a_failing_meanwhile_raises_after_the_call_and_the_next_calls_go_on():
    r0, r1 = spawn(_failing_meanwhile, 2, timeout=60)
    assert r0 == ["boom", [11.0], [21.0]]
    assert r1 == [[0.0], [10.0], [20.0]]


def test_a_group_s_routing_does_not_keep_its_transport_alive():
    import gc

    from hybridembed.distributed import exchange

    class Stand:  # (a transport stand-in: only its lifetime matters here)
        pass

    group, t = object(), Stand()
    exchange.through_shared(group, t)
    assert exchange.shared_of(group) is t
    del t
    gc.collect()
    assert exchange.shared_of(group) is None
    exchange.through_shared(group, None)
    assert exchange.shared_of(group) is None


def _refused(rank: int, world: int) -> bool:
    os.environ[shm.ENV] = "0" if rank == 1 else "1"  # one rank turned it off: nobody uses it
    return shm.Transport.open(dist.group.WORLD, torch.device("cpu")) is None


def test_one_rank_that_cannot_share_turns_it_off_for_every_rank():
    assert spawn(_refused, 2, timeout=60) == [True, True]


def test_files_of_processes_that_no_longer_run_are_swept_a_minute_on(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "DIR", str(tmp_path))
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = tmp_path / f"hybridembed-{dead}-77-abcdef-0-1-3"
    stale_control = tmp_path / f"hybridembed-{dead}-77-abcdef-1-c"
    young = tmp_path / f"hybridembed-{dead}-77-abcdef-0-0-1"  # (perhaps a process of another PID namespace)
    alive = tmp_path / f"hybridembed-{os.getpid()}-77-abcdef-0-0-1"
    other = tmp_path / "hybridembed-notes.txt"
    for p in (stale, stale_control, young, alive, other):
        p.write_bytes(b"x")
    for p in (stale, stale_control, alive, other):
        os.utime(p, (time.time() - 120, time.time() - 120))
    shm._sweep()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, alive.name, other.name])


def test_a_process_that_holds_a_peer_s_pid_but_started_at_another_time_is_not_the_peer():
    """A peer's files carry its PID and start time: a process found at that PID that started at
    another time (the PID given again after the peer ended, or a process of another PID namespace)
    is not taken for the peer; a zombie neither; a name without a start time is judged by its PID."""
    start = shm._stat(os.getpid())[1]
    assert shm._runs(f"hybridembed-{os.getpid()}-{start}-abcdef")
    assert not shm._runs(f"hybridembed-{os.getpid()}-{start + 1}-abcdef")
    assert shm._runs(f"hybridembed-{os.getpid()}-0-abcdef") and shm._runs(f"hybridembed-{os.getpid()}-abcdef")
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    time.sleep(0.1)  # (a zombie until waited for)
    assert shm._stat(gone)[0] == b"Z" and not shm._runs(f"hybridembed-{gone}-{shm._stat(gone)[1]}-abcdef")
    os.waitpid(gone, 0)
    assert not shm._runs(f"hybridembed-{gone}-1-abcdef")


def _in_place_job(rank: int, world: int) -> dict:
    """Every rows' exchange large enough for shared memory, through it and through gloo (the choice
    is read when a collection's first large exchange runs); the model changes its lookups' outputs
    in place (this rank's own rows are the owner's kernel output, not copied)."""
    import hybridembed as he
    from hybridembed.distributed import Plan, ShardedCollection, runtime, shard_table

    runtime.FOLD_ROWS = 0
    tables = [he.TableConfig("a", 40, 8), he.TableConfig("b", 30, 4), he.TableConfig("c", 50, 8)]
    plan = Plan(world, (shard_table(tables[0], "table_wise", (0,)), shard_table(tables[1], "table_wise", (1,)),
                        shard_table(tables[2], "row_wise", (0, 1))))  # fmt: skip
    res = {}
    for shared in (False, True):
        os.environ[shm.ENV] = "1" if shared else "0"
        ec = ShardedCollection(tables, plan=plan, seed=2)
        opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.3), ec)
        outs = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            out = ec({t.name: torch.randint(0, t.num_embeddings, (6, 2), generator=g) for t in tables})
            for x in out.values():
                x.mul_(3).add_(0.5)  # (in place, after the exchange)
            outs.append({k: v.detach().clone() for k, v in out.items()})
            opt.zero_grad()
            sum((v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in out.values()).backward()
            opt.step()
        res[shared] = {"outs": outs, "tables": {t.name: ec.gather_table(t.name) for t in tables},
                       "shared": ec._shm is not None}  # fmt: skip
    return res


def test_outputs_changed_in_place_train_as_through_gloo():
    for r in spawn(_in_place_job, 2, timeout=120):
        g, s = r[False], r[True]
        assert s["shared"] and not g["shared"]
        for a, b in zip(g["outs"], s["outs"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.equal(g["tables"][k], s["tables"][k]) for k in g["tables"])


class _Noted:
    copies: list = []

    def own(self) -> None:
        _Noted.copies.append(1)


def _lent(rank: int, world: int) -> dict:
    """Rank 0 keeps views of rank 1's gather past its next call (lent: copied then); rank 1 runs
    ahead and writes its call after that into the same file while rank 0 still holds them."""
    from hybridembed.optim.hooks import RowParts

    t = shm.Transport.open(dist.group.WORLD, torch.device("cpu"))
    got = t.all_gather(_piece(0, rank, 50))
    kept = RowParts([got[1][0]], [got[1][1]])
    raw = got[1][1]  # (a view not lent)
    t.lend(kept.own)
    gone = _Noted()
    t.lend(gone.own)
    del gone  # (a lender no longer alive is not called)
    t.all_gather(_piece(1, rank, 50))
    out = {}
    if rank == 0:
        time.sleep(1.0)  # (rank 1 has written its next call by now: the file of call 0's parity)
        ref = _piece(0, 1, 50)
        out = {
            "kept": torch.equal(kept.ids[0], ref[0]) and torch.equal(kept.rows[0], ref[1]),
            "raw overwritten": torch.equal(raw, _piece(2, 1, 50)[1]),
        }
    t.all_gather(_piece(2, rank, 50))
    out["noted"] = len(_Noted.copies)
    t.close()
    return out


@pytest.mark.skipif(not os.access(shm.DIR, os.W_OK), reason="no writable /dev/shm")
def test_views_lent_past_the_next_call_are_copied_before_a_peer_writes_there_again():
    r0, r1 = spawn(_lent, 2, timeout=60)
    assert r0 == {"kept": True, "raw overwritten": True, "noted": 0} and r1 == {"noted": 0}
