"""A parameter server's handler against bad requests, in one process (no spawn): 1,000 malformed
requests (seeded) each get an error reply and change nothing (rows, optimizer state, step
counters); then valid pulls and pushes still give the rows a plain EmbeddingCollection gives.
And the wire format's round trips and header checks; the pull and push payloads' round trips
and the malformed payloads they refuse."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import ShardedCollection
from hybridembed.ps import TableServer, ps_plan, wire
from hybridembed.ps.payload import PullItem, PullRequest, PushItem, PushRequest
from hybridembed.ps.server import ShardRef
from hybridembed.ps.wire import Message, WireError
from tests.procs import world_of_one

TRAINER = 5  # a fake trainer rank (the server is rank 0 of a world of 1)
LIMIT = 1 << 16
TABLES = [
    he.TableConfig("a", 100, 8),
    he.TableConfig("b", 50, 4, combiner="mean"),
    he.TableConfig("q", None, 4, dynamic=he.Dynamic()),
]
HP = {"lr": 0.1, "lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0, "eps": 1e-10, "maximize": False}


@pytest.fixture(scope="module")
def world1():
    with world_of_one():
        yield


def _server(mode: str = "sync") -> TableServer:
    sc = ShardedCollection(TABLES, plan=ps_plan(None, TABLES, 1, [0]), seed=5)
    return TableServer(sc, [TRAINER], mode=mode, limit=LIMIT)


def _ints(*xs) -> torch.Tensor:
    return torch.tensor([int(x) for x in xs], dtype=torch.int64)


def _call(srv: TableServer, m: Message, src: int = TRAINER) -> list:
    h, p = wire.pack(m)
    replies, ck = srv.handle(src, h, p)
    assert ck is None
    return replies


def _attach(srv: TableServer) -> None:
    for g in range(3):
        meta = {"group": g, "optimizer": "Adagrad", "hparams": HP}
        ((dst, r),) = _call(srv, Message(wire.ATTACH, 1, 0, _ints(), None, meta))
        assert dst == TRAINER and r.op == wire.OK


def _push(step: int, pairs, floats, meta=None, req: int = 9) -> Message:
    """pairs: [(shard, ids)] -> a push of ``floats``."""
    head = [0, len(pairs)] + [x for s, ids in pairs for x in (s, len(ids))]
    ints = _ints(*head, *(i for _, ids in pairs for i in ids))
    meta = {"had": [0, 1, 2], "hp": {str(g): HP for g in range(3)}} if meta is None else meta
    return Message(wire.PUSH, req, step, ints, floats, meta)


def _pull(step: int, pairs, seen=(), train: bool = True, req: int = 8) -> Message:
    head = [int(train), len(pairs)] + [x for s, ids in pairs for x in (s, len(ids))]
    return Message(wire.PULL, req, step, _ints(*head, *(i for _, ids in pairs for i in ids), *seen))


# --- what "nothing changed" compares ---------------------------------------------------------
def _snap(x, depth: int = 0):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype)):
        return x
    if depth > 4:
        return None
    if isinstance(x, dict):
        return {k: _snap(v, depth + 1) for k, v in x.items() if not str(k).startswith("_") or k == "_parameters"}
    if isinstance(x, (list, tuple, set)):
        return [_snap(v, depth + 1) for v in (sorted(x, key=repr) if isinstance(x, set) else x)]
    if isinstance(x, nn.Module):
        return {k: _snap(v, depth + 1) for k, v in vars(x).items() if not k.endswith("hooks") and k != "_modules"}
    return repr(type(x))


def _state(srv: TableServer) -> dict:
    storages = []
    for st in srv.storages:
        d = {k: _snap(v) for k, v in vars(st).items() if not k.endswith("hooks") and k not in ("_gen", "optimizer")}
        d["gen"] = st._gen.get_state() if hasattr(st, "_gen") else None
        storages.append(d)
    keep = ("applied", "done", "active", "specs", "checkpoint", "lost", "held")
    server = {k: _snap(getattr(srv, k)) for k in keep}
    server["steps"] = {s: sorted(x.by_trainer) for s, x in srv.steps.items()}
    server["deferred"] = [(s, m.req) for s, m in srv.deferred]
    server["hparams"] = {i: {k: v for k, v in g.items() if k != "params"} for i, g in srv.hparams.items()}
    return {"storages": storages, "server": server}


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        bits = (lambda t: t.reshape(-1).view(torch.uint8)) if a.is_floating_point() else (lambda t: t)
        assert torch.equal(bits(a), bits(b)), where  # (bit for bit: rows not yet used may hold nan)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{where}: {a!r} != {b!r}"


# --- malformed requests -----------------------------------------------------------------------
def _named_cases(srv: TableServer) -> list[tuple[str, int, torch.Tensor, torch.Tensor | None, str]]:
    """(what, src, header, payload, part of the error) for each kind of bad request."""
    cases = []

    def add(what: str, m: Message, match: str, src: int = TRAINER) -> None:
        h, p = wire.pack(m)
        cases.append((what, src, h, p, match))

    def raw(what: str, header: list[int], payload: torch.Tensor | None, match: str) -> None:
        cases.append((what, TRAINER, torch.tensor(header, dtype=torch.int64), payload, match))

    g4 = torch.ones(4)
    good_pull = _pull(1, [(0, [1, 2])])
    add("not a trainer", good_pull, "rank 3 is not a trainer", src=3)
    add("the server itself", good_pull, "rank 0 is not a trainer", src=0)
    raw("bad magic", [1, wire.PULL, 1, 0, 0, 0, 0, -1], None, "bad magic")
    raw("unknown op", [wire.MAGIC, 99, 1, 0, 0, 0, 0, -1], None, "unknown op 99")
    raw("a reply status as op", [wire.MAGIC, 0, 1, 0, 0, 0, 0, -1], None, "unknown op 0")
    raw("unknown dtype", [wire.MAGIC, wire.PUSH, 1, 0, 0, 4, 0, 7], None, "unknown float dtype code 7")
    raw("floats without dtype", [wire.MAGIC, wire.PUSH, 1, 0, 0, 4, 0, -1], None, "without a dtype")
    raw("negative sizes", [wire.MAGIC, wire.PULL, 1, 0, -3, 0, 0, -1], None, "negative payload sizes")
    raw("negative step", [wire.MAGIC, wire.PULL, 1, -1, 0, 0, 0, -1], None, "negative step")
    raw("oversized", [wire.MAGIC, wire.PUSH, 1, 0, LIMIT, 0, 0, -1], None, "over the limit")
    raw("oversized floats", [wire.MAGIC, wire.PUSH, 1, 0, 0, 1 << 62, 0, 0], None, "over the limit")
    raw("short header", [wire.MAGIC, wire.PULL, 1, 0], None, "a header is 8 int64")
    h, p = wire.pack(good_pull)
    cases.append(("payload shorter", TRAINER, h, p[:-3], "the header says"))
    cases.append(("payload longer", TRAINER, h, torch.cat([p, p[:5]]), "the header says"))
    cases.append(("no payload", TRAINER, h, None, "the header says"))
    cases.append(("payload not uint8", TRAINER, h, p.to(torch.int16), "uint8"))
    cases.append(("payload not 1-D", TRAINER, h, p.view(-1, 8), "one dimension"))
    cases.append(("float header", TRAINER, h.double(), p, "a header is 8 int64"))
    # pulls
    add("pull: no ints", Message(wire.PULL, 1, 1, _ints()), "needs ints")
    add("pull: unknown shard", _pull(1, [(7, [1])]), "shard 7 is not held here (no such shard)")
    add("pull: negative shard", _pull(1, [(-1, [1])]), "no such shard")
    add("pull: shard of another rank", _pull(1, [(3, [1])]), "shard of rank 1")
    add("pull: dense id out of range", _pull(1, [(0, [1, 100])]), "ids must be in [0, 100)")
    add("pull: negative dense id", _pull(1, [(1, [-2])]), "ids must be in [0, 50)")
    add("pull: pairs too many", Message(wire.PULL, 1, 1, _ints(1, 5, 0, 1)), "5 pairs do not fit")
    add("pull: negative pairs", Message(wire.PULL, 1, 1, _ints(1, -1)), "-1 pairs")
    add("pull: count too big", Message(wire.PULL, 1, 1, _ints(1, 1, 0, 9, 1)), "9 ids do not fit")
    add("pull: negative count", Message(wire.PULL, 1, 1, _ints(1, 1, 0, -1, 1)), "-1 ids do not fit")
    add("pull: ints left over", Message(wire.PULL, 1, 1, _ints(1, 1, 0, 1, 1, 7)), "left over")
    add("pull: dynamic without counts", _pull(1, [(2, [11, 12])]), "count per id")
    add("pull: dynamic count 0", _pull(1, [(2, [11, 12])], seen=[1, 0]), "times seen must be >= 1")
    add("pull: dynamic counts huge", _pull(1, [(2, [11])], seen=[1 << 40]), "times seen")
    add("pull: a step far ahead", _pull(5, [(0, [1])]), "step 5")
    # pushes
    add("push: floats short", _push(1, [(0, [1, 2])], torch.ones(15)), "needs 16 gradient values, got 15")
    add("push: floats long", _push(1, [(1, [1])], torch.ones(5)), "needs 4 gradient values, got 5")
    add("push: no floats", _push(1, [(1, [1])], None), "needs 4 gradient values, got 0")
    add("push: nan", _push(1, [(1, [1])], torch.tensor([0.0, math.nan, 0, 0])), "non-finite")
    add("push: inf", _push(1, [(2, [4])], torch.tensor([0.0, 0, -math.inf, 0])), "non-finite")
    add("push: wrong step", _push(3, [(1, [1])], g4), "pushed step 3, expected step 1")
    add("push: dense id out of range", _push(1, [(1, [50])], g4), "ids must be in [0, 50)")
    add("push: unknown shard", _push(1, [(9, [1])], g4), "no such shard")
    add("push: shard of another rank", _push(1, [(3, [1])], g4), "shard of rank 1")
    add("push: meta missing", _push(1, [(1, [1])], g4, meta={}), "a push needs meta")
    add("push: had not ints", _push(1, [(1, [1])], g4, meta={"had": ["x"], "hp": {}}), "a push needs meta")
    add("push: hp not a dict", _push(1, [(1, [1])], g4, meta={"had": [1], "hp": [1]}), "a push needs meta")
    bad_hp = [
        ({"1": {"lr": "fast"}}, "lr must be a finite number"),
        ({"1": {"lr": -1.0}}, "lr must be >= 0"),
        ({"1": {"lr": None}}, "lr must be a finite number"),
        ({"1": {"momentum": 0.9}}, "unknown hyper-parameter"),
        ({"1": 3}, "hyper-parameters of group 1"),
        ({"x": {"lr": 0.1}}, "group 'x'"),
        ({"7": {"lr": 0.1}}, "group 7"),
    ]
    for hp, match in bad_hp:
        add(f"push: hp {hp}", _push(1, [(1, [1])], g4, meta={"had": [1], "hp": hp}), match)
    add("push: hp lr nan", _push(1, [(1, [1])], g4, meta={"had": [1], "hp": {"1": {"lr": math.nan}}}), "finite")
    # attach
    for meta, match in [
        ({}, "attach needs meta"),
        ({"group": "0", "optimizer": "Adagrad", "hparams": HP}, "attach needs meta"),
        ({"group": 0, "optimizer": "Adagard", "hparams": HP}, "unknown optimizer 'Adagard'"),
        ({"group": 0, "optimizer": "Adagrad", "hparams": {"lr": -1}}, "lr must be >= 0"),
        ({"group": 0, "optimizer": "Adagrad", "hparams": {"lr": "x"}}, "lr must be a finite number"),
        ({"group": 0, "optimizer": "Adagrad", "hparams": {"betas": [0.9, 0.99]}}, "unknown hyper-parameter"),
        ({"group": 0, "optimizer": "SGD", "hparams": {"lr": 0.1}}, "group 0 is attached to Adagrad"),
        ({"group": 9, "optimizer": "Adagrad", "hparams": HP}, "group 9"),
        ({"group": -1, "optimizer": "Adagrad", "hparams": HP}, "group -1"),
    ]:
        add(f"attach {meta}", Message(wire.ATTACH, 1, 0, _ints(), None, meta), match)
    # checkpoint and read
    for meta, match in [
        ({}, "checkpoint needs meta"),
        ({"action": "delete", "path": "x"}, "checkpoint needs meta"),
        ({"action": "save", "path": 3}, "checkpoint needs meta"),
        ({"action": "save", "path": "x", "keep": "two"}, "keep"),
        ({"action": "save", "path": "x", "keep": 0}, "keep"),
        ({"action": "save", "path": "x", "incremental": "yes"}, "incremental"),
        ({"action": "save", "path": "x", "max_chain": -1}, "max_chain"),
        ({"action": "load", "path": "x", "verify": 1.5}, "verify"),
        ({"action": "save", "path": "x", "optimizer": "no"}, "optimizer"),
    ]:
        add(f"checkpoint {meta}", Message(wire.CHECKPOINT, 1, 0, _ints(), None, meta), match)
    for meta, match in [({}, "unknown table None"), ({"table": "zz"}, "unknown table 'zz'"), ({"table": [1]}, "table")]:
        add(f"read {meta}", Message(wire.READ, 1, 0, _ints(), None, meta), match)
    add("read: a step far ahead", Message(wire.READ, 1, 7, _ints(), None, {"table": "a"}), "step 7")
    # meta that is not JSON, or not an object
    for blob, match in [(b"\xff\xfe", "meta is not JSON"), (b"{", "meta is not JSON"), (b"[1, 2]", "JSON object")]:
        h = torch.tensor([wire.MAGIC, wire.ATTACH, 1, 0, 0, 0, len(blob), -1], dtype=torch.int64)
        cases.append((f"meta {blob!r}", TRAINER, h, torch.frombuffer(bytearray(blob), dtype=torch.uint8), match))
    return cases


def _random_cases(rng: random.Random, n: int, done: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``n`` seeded malformed requests: random headers, valid headers with random payloads,
    valid requests whose payload is cut or padded, requests of valid form with bad contents
    (``done``: the steps the trainer has pushed)."""
    out = []
    big = 1 << 63

    def rint(lo: int = -big, hi: int = big - 1) -> int:
        return rng.randint(lo, hi)

    def rbytes(k: int) -> torch.Tensor | None:
        return torch.tensor([rng.randrange(256) for _ in range(k)], dtype=torch.uint8) if k else None

    while len(out) < n:
        kind = rng.randrange(6)
        if kind == 0:  # a random header, maybe a payload
            h = torch.tensor([rint() for _ in range(wire.HEAD)], dtype=torch.int64)
            if rng.random() < 0.5:
                h[0] = wire.MAGIC
            out.append(("random header", h, rbytes(rng.randrange(64))))
        elif kind == 1:  # a valid header, random payload bytes (meta that is not JSON)
            op = rng.choice([wire.ATTACH, wire.PULL, wire.PUSH, wire.CHECKPOINT, wire.READ])
            ni, nj = rng.randrange(8), rng.randrange(1, 40)
            nf, code = (rng.randrange(8), rng.randrange(len(wire.DTYPES))) if rng.random() < 0.5 else (0, -1)
            size = 8 * ni + (wire.DTYPES[code].itemsize * nf if code >= 0 else 0) + nj
            h = torch.tensor([wire.MAGIC, op, rint(0, 99), rint(0, 3), ni, nf, nj, code], dtype=torch.int64)
            p = rbytes(size)
            p[-nj] = 0xFF  # (not UTF-8: never JSON)
            out.append(("random payload", h, p))
        elif kind == 2:  # a valid header, random ints (no meta): pulls and pushes that do not parse
            op = rng.choice([wire.PULL, wire.PUSH])
            k = rng.randrange(0, 12)
            ints = torch.tensor([rint() for _ in range(k)], dtype=torch.int64)
            if k >= 2 and rng.random() < 0.5:
                ints[1] = rng.randrange(1, 4) + k  # (pairs that cannot fit)
            out.append(("random ints", *wire.pack(Message(op, 3, 0, ints))))
        elif kind == 3:  # a valid request cut short or padded
            m = _pull(done, [(0, [rng.randrange(100)]), (2, [rint()])], seen=[1])
            h, p = wire.pack(m)
            cut = rng.randrange(1, p.numel())
            p = p[:-cut] if rng.random() < 0.5 else torch.cat([p, rbytes(cut)])
            out.append(("wrong size", h, p))
        elif kind == 4:  # out-of-range ids and unknown shards
            shard = rng.choice([0, 1, rng.randrange(3, 1000), -rng.randrange(1, 1000)])
            rows = {0: 100, 1: 50}.get(shard, 10)
            bad = rng.choice([rng.randrange(rows, 1 << 40), -rng.randrange(1, 1 << 40)])
            ids = [rng.randrange(rows) for _ in range(rng.randrange(4))] + [bad]
            rng.shuffle(ids)
            if rng.random() < 0.5:
                out.append(("bad ids pull", *wire.pack(_pull(done, [(shard, ids)]))))
            else:
                width = {0: 8, 1: 4}.get(shard, 4)
                out.append(("bad ids push", *wire.pack(_push(done, [(shard, ids)], torch.randn(len(ids) * width)))))
        else:  # a push of good ids whose gradients are wrong: size, non-finite, or of a wrong step
            ids = [rng.randrange(50) for _ in range(rng.randrange(1, 5))]
            g = torch.randn(len(ids) * 4, dtype=rng.choice([torch.float32, torch.float64]))
            step = done
            what = rng.randrange(3)
            if what == 0:
                g = g[: rng.randrange(g.numel())] if rng.random() < 0.5 else torch.cat([g, g[:1]])
            elif what == 1:
                g[rng.randrange(g.numel())] = rng.choice([math.nan, math.inf, -math.inf])
            else:
                step = rng.choice([done + rng.randrange(1, 1 << 40), done + rng.randrange(1, 4), done - 1])
            out.append(("bad push", *wire.pack(_push(step, [(1, ids)], g))))
    return out


def test_malformed_requests_get_errors_and_change_nothing(world1):
    srv = _server()
    _attach(srv)
    # a step applied first (optimizer state and step counters are not at their initial values)
    srv.refs.append(ShardRef(len(srv.refs), "a", 1, 1, "a@1", 10, 8))  # (a shard of another rank: index 3)
    assert _call(srv, _push(0, [(0, [1, 2])], torch.ones(16))) == []
    before = _state(srv)
    n_errors = srv.stats_["errors"]
    cases = _named_cases(srv)
    for what, src, h, p, match in cases:
        replies, ck = srv.handle(src, h, p)
        assert ck is None, what
        assert len(replies) == 1, what
        dst, r = replies[0]
        assert dst == src and r.op == wire.ERROR, what
        assert match in r.meta["error"], f"{what}: {r.meta['error']!r} does not say {match!r}"
        assert r.meta["error"].startswith("server rank 0: "), what
        _same(_state(srv), before, what)
    rng = random.Random(1234)
    randoms = _random_cases(rng, 1000 - len(cases), done=1)
    for what, h, p in randoms:
        replies, ck = srv.handle(TRAINER, h, p)
        assert ck is None and len(replies) == 1 and replies[0][1].op == wire.ERROR, (what, h.tolist())
        assert replies[0][0] == TRAINER and isinstance(replies[0][1].meta["error"], str)
    _same(_state(srv), before, "after the random requests")
    assert srv.stats_["errors"] == n_errors + 1000
    # a reply packs and unpacks (what the trainer reads)
    h, p = wire.pack(replies[0][1])
    assert wire.unpack(h, p, 1 << 62, replies=True) == replies[0][1]


def test_valid_requests_after_bad_ones_equal_an_embedding_collection(world1):
    """A server that refused 300 bad requests trains 3 steps like one process."""
    srv = _server()
    _attach(srv)
    rng = random.Random(7)
    for _, h, p in _random_cases(rng, 300, done=0):
        assert srv.handle(TRAINER, h, p)[0][0][1].op == wire.ERROR
    ref = he.EmbeddingCollection(TABLES, seed=5)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ref.parameters(), lr=0.1), ref)
    g = torch.Generator().manual_seed(3)
    widths = {"a": 8, "b": 4, "q": 4}
    for step in range(3):
        x = {"a": torch.randint(0, 100, (6,), generator=g), "b": torch.randint(0, 50, (6,), generator=g)}
        x["q"] = torch.randint(-5, 5, (6,), generator=g) * 1_000_003
        grads = {f: torch.randn(6, widths[f], generator=g) for f in x}
        out = ref(x)  # (B, D) per feature: one id per bag, so a row per id
        pairs, seen = [], []
        uniq = {}
        for k, f in enumerate(("a", "b", "q")):
            u, counts = torch.unique(x[f], return_counts=True)
            uniq[f] = u
            pairs.append((k, u.tolist()))
            if f == "q":
                seen = counts.tolist()
        # a bad request between the pull and the push changes nothing either
        assert _call(srv, _push(step, [(1, [60])], torch.ones(4)))[0][1].op == wire.ERROR
        ((_, r),) = _call(srv, _pull(step, pairs, seen))
        assert r.op == wire.OK, r.meta
        got = r.floats.split([uniq[f].numel() * widths[f] for f in ("a", "b", "q")])
        for f, rows in zip(("a", "b", "q"), got):
            first = [int((x[f] == i).nonzero()[0]) for i in uniq[f]]
            torch.testing.assert_close(rows.view(-1, widths[f]), out[f][first].detach(), atol=0, rtol=0)
        loss = sum((out[f] * grads[f]).sum() for f in x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        push_pairs = [(k, x[f].tolist()) for k, f in enumerate(("a", "b", "q"))]
        flat = torch.cat([grads[f].reshape(-1) for f in ("a", "b", "q")])
        assert _call(srv, _push(step, push_pairs, flat)) == []
    assert srv.applied == 3 and srv.stats_["errors"] == 303
    for name in ("a", "b"):
        torch.testing.assert_close(srv.sc.local.weight(name), ref.weight(name), atol=1e-6, rtol=1e-6)
    ids, rows = srv.sc.local.dynamic_rows("q@0")
    ref_ids, ref_rows = ref.dynamic_rows("q")
    o, ro = torch.argsort(ids), torch.argsort(ref_ids)
    assert torch.equal(ids[o], ref_ids[ro])
    torch.testing.assert_close(rows[o], ref_rows[ro], atol=1e-6, rtol=1e-6)


def test_async_server_refuses_a_push_of_a_wrong_step(world1):
    srv = _server("async")
    _attach(srv)
    g4 = torch.ones(4)
    ((_, r),) = _call(srv, _push(2, [(1, [1])], g4))
    assert r.op == wire.ERROR and "pushed step 2, expected step 0" in r.meta["error"]
    assert srv.done[TRAINER] == 0
    assert _call(srv, _push(0, [(1, [1])], g4)) == [] and srv.done[TRAINER] == 1


# --- the wire format ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", wire.DTYPES)
def test_pack_unpack_round_trip(dtype):
    rng = random.Random(11)
    for _ in range(20):
        ints = torch.tensor([rng.randint(-(1 << 63), (1 << 63) - 1) for _ in range(rng.randrange(5))])
        floats = None if rng.random() < 0.3 else torch.randn(rng.randrange(6)).to(dtype)
        meta = rng.choice([{}, {"a": [1, 2.5, "x"], "b": {"c": None}}, {"error": "é ✓"}])
        m = Message(rng.choice(list(wire.OPS)), rng.randrange(1 << 40), rng.randrange(1 << 40), ints, floats, meta)
        h, p = wire.pack(m)
        assert h.dtype == torch.int64 and h.shape == (wire.HEAD,)
        assert wire.check_header(h, 1 << 20) == (0 if p is None else p.numel())
        back = wire.unpack(h, p, 1 << 20)
        assert back == m and (back.floats is None or back.floats.dtype == dtype)
    r = Message(wire.ERROR, 3, 0, torch.zeros(0, dtype=torch.int64), None, {"error": "no"})
    assert wire.unpack(*wire.pack(r), 1024, replies=True) == r
    with pytest.raises(WireError, match="bad reply status"):
        wire.check_header(wire.pack(Message(wire.PULL, 1, 0, _ints()))[0], 1024, replies=True)
    ok = Message(wire.OK, 3, 0, torch.zeros(0, dtype=torch.int64))
    with pytest.raises(WireError, match="unknown op 0"):  # (a reply is not a request)
        wire.check_header(wire.pack(ok)[0], 1024)
    with pytest.raises(WireError, match="cannot be sent"):
        wire.pack(Message(wire.PUSH, 1, 0, _ints(), torch.ones(2, dtype=torch.int32)))


def test_check_header_limits():
    def header(ni=0, nf=0, nj=0, code=-1, op=wire.PULL, step=0):
        return torch.tensor([wire.MAGIC, op, 1, step, ni, nf, nj, code], dtype=torch.int64)

    assert wire.check_header(header(ni=2, nf=3, nj=5, code=1), 100) == 16 + 24 + 5
    assert wire.check_header(header(ni=128), 1024) == 1024
    with pytest.raises(WireError, match="1032 bytes is over the limit of 1024"):
        wire.check_header(header(ni=129), 1024)
    with pytest.raises(WireError, match="over the limit"):  # (no overflow of the product)
        wire.check_header(header(nf=(1 << 62) + 1, code=0), 1 << 62)
    with pytest.raises(WireError, match="over the limit"):
        wire.check_header(header(nj=1 << 40), 1 << 20)
    for bad, match in [
        (header(code=4), "unknown float dtype code 4"),
        (header(code=-2), "unknown float dtype code -2"),
        (header(nf=1), "1 floats without a dtype"),
        (header(nj=-1), "negative payload sizes"),
        (header(op=8), "unknown op 8"),
        (header(step=-5), "negative step -5"),
        (torch.zeros(8, dtype=torch.int64), "bad magic 0x0"),
        (torch.zeros(9, dtype=torch.int64), "a header is 8 int64, got 9"),
        (header().to(torch.int32), "a header is 8 int64"),
    ]:
        with pytest.raises(WireError, match=match.replace("(", r"\(")):
            wire.check_header(bad, 1024)
    m = Message(wire.ATTACH, 1, 0, _ints(), None, {"k": "v" * 2000})
    h, p = wire.pack(m)
    with pytest.raises(WireError, match="over the limit of 1024"):
        wire.unpack(h, p, 1024)
    assert json.loads(bytes(p.numpy()).decode()) == m.meta


# --- the payloads of a pull and a push -----------------------------------------------------------
def _dynamic(shard: int) -> bool:  # (in these tests shard 2 is the dynamic one, as in TABLES)
    return shard == 2


def _width(shard: int) -> int:
    return {0: 8, 1: 4, 2: 4}[shard]


def test_pull_payload_round_trip_in_the_format_of_the_wire():
    rng = random.Random(5)
    for _ in range(30):
        items = []
        for _ in range(rng.randrange(4)):
            shard = rng.randrange(3)
            ids = torch.tensor([rng.randrange(-(1 << 40), 1 << 40) for _ in range(rng.randrange(4))], dtype=torch.int64)
            seen = torch.randint(1, 9, ids.shape) if _dynamic(shard) else None
            items.append(PullItem(shard, ids, seen))
        pull = PullRequest(rng.random() < 0.5, items)
        ints, floats = pull.pack()
        assert floats is None
        seen = [int(x) for it in items if it.seen is not None for x in it.seen]
        old = _pull(0, [(it.shard, it.ids.tolist()) for it in items], seen, train=pull.train)  # (the format as was)
        assert torch.equal(ints, old.ints)
        assert PullRequest.unpack(ints, floats, dynamic=_dynamic) == pull
    # a message's round trip as well
    pull = PullRequest(False, [PullItem(0, torch.tensor([1, 2]))])
    m = wire.unpack(*wire.pack(Message(wire.PULL, 1, 0, *pull.pack())), LIMIT)
    assert PullRequest.unpack(m.ints, m.floats, dynamic=_dynamic) == pull


@pytest.mark.parametrize("dtype", wire.DTYPES)
def test_push_payload_round_trip_in_the_format_of_the_wire(dtype):
    rng = random.Random(6)
    for _ in range(30):
        items = []
        for _ in range(rng.randrange(4)):
            shard = rng.randrange(3)
            ids = torch.tensor([rng.randrange(1 << 40) for _ in range(rng.randrange(4))], dtype=torch.int64)
            items.append(PushItem(shard, ids, torch.randn(ids.numel(), _width(shard)).to(dtype)))
        push = PushRequest(items)
        ints, floats = push.pack()
        assert (floats is None) == (not items)
        old = _push(0, [(it.shard, it.ids.tolist()) for it in items], floats)  # (the format as was)
        assert torch.equal(ints, old.ints)
        back = PushRequest.unpack(ints, floats, width=_width)
        assert back == push and all(it.rows.dtype == dtype for it in back.items)
    assert PushRequest.unpack(*PushRequest([]).pack(), width=_width) == PushRequest([])


def test_a_pulls_items_that_a_server_refuses():
    def refuse(shard: int) -> bool:
        raise WireError(f"shard {shard} is not held here")

    with pytest.raises(WireError, match="shard 1 is not held here"):
        PullRequest.unpack(_ints(1, 1, 1, 1, 5), None, dynamic=refuse)
    with pytest.raises(WireError, match="shard 0 is not held here"):
        PushRequest.unpack(_ints(0, 1, 0, 1, 5), torch.ones(8), width=refuse)


@pytest.mark.parametrize(
    "ints, floats, match",
    [
        (_ints(), None, r"a pull needs ints \[flags, n, \(shard, count\) \* n, ids...\], got 0"),
        (_ints(1), None, "a pull needs ints"),
        (torch.tensor([1, 0], dtype=torch.int32), None, "a pull's ints must be int64 of one dimension"),
        (_ints(1, 0).view(1, 2), None, "a pull's ints must be int64 of one dimension"),
        (_ints(1, -1), None, "-1 pairs do not fit in the 2 ints of a pull"),
        (_ints(1, 5, 0, 1), None, "5 pairs do not fit in the 4 ints of a pull"),
        (_ints(1, 1, 0, -1, 1), None, r"shard 0: -1 ids do not fit in the request \(1 ints left\)"),
        (_ints(1, 1, 0, 9, 1), None, "shard 0: 9 ids do not fit"),
        (_ints(1, 2, 0, 1, 1, 1, 5), None, "shard 1: 1 ids do not fit"),
        (_ints(1, 1, 0, 1, 1, 7), None, "1 ints left over after 1 pairs"),
        (_ints(1, 1, 2, 2, 11, 12), None, r"shard 2: a dynamic table's pull needs a count per id \(2 ids, 0 ints"),
        (_ints(1, 1, 2, 2, 11, 12, 1), None, "needs a count per id"),
        (_ints(1, 1, 2, 2, 11, 12, 1, 0), None, "shard 2: times seen must be >= 1, got 0"),
        (_ints(1, 1, 2, 1, 11, -4), None, "times seen must be >= 1, got -4"),
        (_ints(1, 1, 2, 1, 11, 1, 1), None, "1 ints left over"),
        (_ints(1, 1, 0, 1, 1, 3), None, "1 ints left over"),  # (a dense shard's ids have no times seen)
        (_ints(1, 0), torch.ones(2), "a pull carries no floats, got 2"),
    ],
)
def test_malformed_pull_payloads_are_refused(ints, floats, match):
    with pytest.raises(WireError, match=match):
        PullRequest.unpack(ints, floats, dynamic=_dynamic)


@pytest.mark.parametrize(
    "ints, floats, match",
    [
        (_ints(0), None, "a push needs ints"),
        (_ints(0, 2, 1, 0), None, "2 pairs do not fit in the 4 ints of a push"),
        (_ints(0, 1, 1, 3, 1, 2), torch.ones(12), "shard 1: 3 ids do not fit"),
        (_ints(0, 1, 1, 1, 1, 2), torch.ones(4), "1 ints left over after 1 pairs"),
        (_ints(0, 1, 1, 2, 1, 2), torch.ones(7), "a push of these ids needs 8 gradient values, got 7"),
        (_ints(0, 1, 0, 2, 1, 2), torch.ones(17), "needs 16 gradient values, got 17"),
        (_ints(0, 1, 1, 1, 1), None, "needs 4 gradient values, got 0"),
        (_ints(0, 0), torch.ones(1), "needs 0 gradient values, got 1"),
    ],
)
def test_malformed_push_payloads_are_refused(ints, floats, match):
    with pytest.raises(WireError, match=match):
        PushRequest.unpack(ints, floats, width=_width)


def test_payload_items_check_their_shapes():
    with pytest.raises(WireError, match="shard 0: 1 times seen for 2 ids"):
        PullItem(0, torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(WireError, match="ids must be of one dimension"):
        PullItem(0, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(WireError, match=r"rows \(U, D\), got ids of shape \(2,\) and rows of shape \(3, 4\)"):
        PushItem(1, torch.tensor([1, 2]), torch.ones(3, 4))
    with pytest.raises(WireError, match="rows of shape"):
        PushItem(1, torch.tensor([1, 2]), torch.ones(8))


def test_unknown_flag_bits_are_refused():
    pull_ints, _ = PullRequest(True, [PullItem(0, torch.tensor([1, 2]))]).pack()
    push_ints, push_floats = PushRequest([PushItem(0, torch.tensor([1]), torch.ones(1, 3))]).pack()
    PullRequest.unpack(pull_ints, None, dynamic=lambda s: False)  # (train: the one known bit)
    with pytest.raises(WireError, match="flags 7 set bits"):
        PullRequest.unpack(torch.cat([torch.tensor([7]), pull_ints[1:]]), None, dynamic=lambda s: False)
    with pytest.raises(WireError, match="flags 1 set bits"):
        PushRequest.unpack(torch.cat([torch.tensor([1]), push_ints[1:]]), push_floats, width=lambda s: 3)
