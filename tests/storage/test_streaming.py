"""5,000,000 distinct ids stream through a dynamic table capped at 1,000,000 rows.

Training-mode forward + backward + Adagrad step on batches of 200,000 new ids (LRU). After
every step: the table never holds more than its capacity, ``evicted == inserted - size``,
and the bytes of every tensor the storage holds (rows, optimizer state, slot arrays, hash
index, sketch, gradient) stay under twice the capped table's rows + optimizer state. The
run happens in a fresh process so that its peak RSS growth (``VmHWM`` of /proc/self/status; not
``ru_maxrss``, which a child started by fork and exec inherits from its parent) is measured
from a clean baseline; it writes its figures (times per phase, peak storage bytes, RSS)
to a JSON file the test reads back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import hybridembed as he

ROOT = Path(__file__).resolve().parents[2]
TOTAL = 5_000_000  # (five times the capacity: every row is evicted four times over)
CAPACITY = 1_000_000
BATCH = 200_000
DIM = 16
LR = 0.05
TABLE_BYTES = CAPACITY * DIM * 4 * 2  # rows + Adagrad state, float32
_SCRAMBLE = -7046029254386353131  # odd: i -> i * C (mod 2**64) is a bijection on int64


def batch_ids(step: int) -> torch.Tensor:
    """Ids of batch ``step``: 200,000 new, distinct, spread over the whole int64 range."""
    return torch.arange(step * BATCH, (step + 1) * BATCH, dtype=torch.int64).mul_(_SCRAMBLE)


def _tensors_of(obj, seen: dict) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse:
            _tensors_of(obj._indices(), seen)
            _tensors_of(obj._values(), seen)
            return
        s = obj.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        if obj.grad is not None:
            _tensors_of(obj.grad, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_of(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors_of(v, seen)


def storage_bytes(storage) -> int:
    """Bytes of every tensor the storage object holds (attributes, parameters, buffers,
    optimizer state, the gradient), each underlying buffer counted once."""
    seen: dict[int, int] = {}
    _tensors_of(dict(vars(storage)), seen)
    return sum(seen.values())


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: its peak in this process)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _stream(out_path: str) -> None:
    """The measured run (in a fresh process)."""
    torch.set_num_threads(1)  # as conftest.py: two threads on a shared 2-core machine ran 5x slower
    base_rss = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    cfg = he.Dynamic(capacity=CAPACITY, eviction="lru")
    ec = he.EmbeddingCollection([he.TableConfig("s", None, DIM, dynamic=cfg)], seed=1)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=LR), ec)
    storage = ec.storage_of("s")
    for name in ("weight", "slot_key", "slot_table", "last_seen", "freq", "free", "_hrow", "_claim"):
        assert isinstance(getattr(storage, name), torch.Tensor), name  # what storage_bytes must see
    offsets = torch.arange(BATCH + 1, dtype=torch.int64)
    rec = {"peak_storage_bytes": 0, "sizes": [], "ok_counts": [], "step_s": [], "phase_s": {}}
    phases = {"forward": 0.0, "backward": 0.0, "step": 0.0, "measure": 0.0}
    for step in range(TOTAL // BATCH):
        ts = time.perf_counter()
        opt.zero_grad()
        out = ec({"s": he.Jagged(batch_ids(step), offsets)})["s"]
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        rec["peak_storage_bytes"] = max(rec["peak_storage_bytes"], storage_bytes(storage))
        st = ec.dynamic_stats()["s"]
        rec["sizes"].append(st["size"])
        rec["ok_counts"].append(st["evicted"] == st["inserted"] - st["size"])
        t4 = time.perf_counter()
        for k, dt in zip(phases, (t1 - ts, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += dt
        rec["step_s"].append(t4 - ts)
        rec.setdefault("rss", []).append(_status_kib("VmRSS") * 1024)
    rec["phase_s"] = phases
    rec["total_s"] = time.perf_counter() - t0
    rec["stats"] = ec.dynamic_stats()["s"]
    ids, rows = ec.dynamic_rows("s")
    rec["ids_equal_last_five_batches"] = bool(
        torch.equal(
            ids, torch.sort(torch.cat([batch_ids(s) for s in range(TOTAL // BATCH - 5, TOTAL // BATCH)])).values
        )
    )
    sample = torch.arange(0, ids.numel(), 99_991)
    want = he.init.generate(he.init.uniform(), 1, "s", ids[sample], DIM) - LR  # one Adagrad step on grad 1
    rec["rows_max_err"] = float((rows[sample] - want).abs().max())
    rec["rss_peak_growth_bytes"] = _status_kib("VmHWM") * 1024 - base_rss
    rec["base_rss_bytes"] = base_rss
    Path(out_path).write_text(json.dumps(rec))


def test_five_million_ids_through_a_one_million_row_table(tmp_path):
    out = tmp_path / "streaming.json"
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.storage.test_streaming import _stream; _stream({str(out)!r})"
    res = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["peak_storage_bytes"] < 2 * TABLE_BYTES, rec["peak_storage_bytes"]
    assert max(rec["sizes"]) <= CAPACITY
    assert rec["sizes"][-1] == CAPACITY and all(rec["ok_counts"])
    stats = rec["stats"]
    assert stats["inserted"] == TOTAL and stats["size"] == CAPACITY
    assert stats["evicted"] == TOTAL - CAPACITY == stats["inserted"] - stats["size"]
    assert stats["lookups"] == TOTAL and stats["hits"] == 0 and stats["rejected"] == 0
    assert rec["ids_equal_last_five_batches"]  # LRU: exactly the most recent 1,000,000 ids remain
    assert rec["rows_max_err"] < 1e-6
    # no leak: once the table is full (step 5 of 25) and the allocator has settled (step 6), resident
    # memory grows by at most a few steps' temporaries: measured +19 MB over the last 19 steps (at
    # 10M ids, +53 MB over 44 steps, flat over the last 30). The peak growth (VmHWM) measured 680-750 MB, 5.3-5.9x the table: the
    # table, its hash index and sketch, and a 200k-id step's temporaries kept by the tuned allocator
    # (he.tune_cpu_allocator); 10M ids measured 775 MB: a plateau, not a slope
    full, last = rec["rss"][5], rec["rss"][-1]
    assert last - full < TABLE_BYTES, (full, last)  # (a leak of a step's ids and rows would add ~10 MB a step)
    assert rec["rss_peak_growth_bytes"] < 8 * TABLE_BYTES, rec["rss_peak_growth_bytes"]
