"""The optimizer's side of a sharded collection: what :class:`~hybridembed.optim.SparseStepHook`
asks of it (:class:`ShardedStep`, a base of :class:`~hybridembed.distributed.ShardedCollection`).

``he.wrap_optimizer`` calls :meth:`ShardedStep.before_sparse_step` on every rank before any
update: a shard's row gradients are scaled by the ``mean`` reduction (shards updated by the
fused Triton step are scaled there, by :meth:`ShardedStep.grad_scale`), a replicated table's
are summed over the ranks (ranks of one machine: each rank's touched rows read from the others'
shared memory; otherwise the touched rows gathered, or a dense all-reduce where the ranks touch
most of the table), and a column slice under a row-wise optimizer gets its whole rows' statistic.
Only the storages :meth:`ShardedStep.needs_rows` names hand their rows over; every other shard
keeps the fused update.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..optim.hooks import RowGrads, RowParts, SparseStepHook

__all__ = ["ShardedStep"]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ShardedStep(SparseStepHook):
    """The step hook of a sharded collection. Reads the collection's ``local`` (its shards),
    ``replicated``, ``tables``, routes, process group and shared-memory transport (``_shared()``);
    holds no state of its own."""

    def needs_rows(self, storage) -> bool:
        """A replicated table's storage (its row gradients are summed over the ranks) and a shard's storage
        holding a column slice under a row-wise optimizer (its rows' statistic is completed across
        slices) need their rows; every other shard keeps the fused update (:class:`SparseStepHook`)."""
        if self.replicated is not None and any(storage is st for st in self.replicated.storages):
            return True
        return any(storage is st for st in self._column_storages())

    def grad_scale(self, storage) -> float:
        """A shard's gradient is the sum of the ranks' (``mean``: divided by the world size)."""
        return self._scale if self.local is not None and any(storage is st for st in self.local.storages) else 1.0

    def _column_storages(self) -> list:
        """This rank's storages holding a column slice under a row-wise optimizer."""
        if not self._column_tables or self.local is None:
            return []
        names = {
            self._routes[t].local_name(pos)
            for t in self._column_tables
            for pos in self._positions_here(self._routes[t])
        }
        out = []
        for st in self.local.storages:
            if getattr(st.optimizer, "row_wise", False) and any(t.name in names for t in st.tables):
                out.append(st)
        return out

    def before_sparse_step(self, storages: list, rows: list[RowGrads | None]) -> list[RowGrads | None]:
        """Every storage's pending :class:`RowGrads` (or None) -> the same, completed across ranks:
        a shard's scaled by :meth:`grad_scale` (those applied fused are scaled there), a replicated
        table's row gradients summed over the ranks (every replica then makes the same update to the rows any
        rank touched), and a column slice under a row-wise optimizer given the mean square of its
        whole rows' gradients (every slice's squares, summed across ranks) as ``row_stat``.
        Collective: every rank calls it each step."""
        rows = list(rows)
        where = {id(st): k for k, st in enumerate(storages)}
        if self._scale != 1.0 and self.local is not None:  # the mean over ranks of the shards' gradients
            for st in self.local.storages:
                k = where.get(id(st))
                if k is not None and rows[k] is not None:
                    rows[k] = RowGrads(rows[k].ids, rows[k].rows * self._scale)
        if self.replicated is not None and self.world_size > 1:
            reps = [(k, st) for st in self.replicated.storages if (k := where.get(id(st))) is not None]
            if reps:
                self._sync_replicas(reps, rows)
        if self._column_tables:
            self._row_statistics(where, storages, rows)
        return rows

    def _sync_replicas(self, reps: list, rows: list) -> None:
        """Replicated tables' row gradients summed over the ranks (``mean``: divided by the world
        size), in place in ``rows``. Ranks of one machine: every rank's touched rows from the others'
        shared memory (:meth:`_sum_through_shared`). Otherwise first every rank's count of touched
        rows per storage (one small all-gather), then per storage the cheaper of: the touched rows
        alone, gathered from every rank (bytes ~ world x the most rows a rank touched: the batch's),
        or a dense all-reduce of a (rows, dim + 1) buffer (bytes ~ the table's, when most rows are
        touched). Every rank makes the same choice (it sees every count)."""
        world = self.world_size
        shared = self._shared() if self._device.type == "cpu" else None  # (ranks of one machine: see shm)
        if shared is not None:
            self._sum_through_shared(shared, reps, rows)
            return
        mine = [0 if rows[k] is None else rows[k].ids.numel() for k, _ in reps]
        counts = torch.tensor(mine, dtype=torch.int64, device=self._device)
        every = counts.new_empty(world * len(reps))
        dist.all_gather_single(every, counts, group=self._group)
        per_rank = every.view(world, len(reps)).tolist()  # (the one host sync)
        for j, (k, st) in enumerate(reps):
            sizes = [row[j] for row in per_rank]
            nrows, dim = st.weight.shape
            if max(sizes) == 0:
                rows[k] = None
            elif world * max(sizes) * (dim + 8 // _itemsize(st.compute_dtype)) <= nrows * (dim + 1):
                rows[k] = self._gather_touched(st, rows[k], sizes)
            else:
                rows[k] = self._sync_replica(st, rows[k])

    def _sum_through_shared(self, shared, reps: list, rows: list) -> None:
        """:meth:`_sync_replicas` for ranks of one machine: every rank writes its touched rows (ids and
        gradients) once into its shared-memory file; the update sums every rank's rows straight from
        theirs (:class:`RowParts`: bytes read ~ the rows the ranks touched, never the table; no count
        exchanged first)."""
        pieces = []
        for k, st in reps:
            pending, dim, cdt = rows[k], st.weight.shape[1], st.compute_dtype
            if pending is None:
                pieces += [torch.empty(0, dtype=torch.int64), torch.empty(0, dim, dtype=cdt)]
            else:
                pieces += [pending.ids.to(torch.int64), pending.rows.to(cdt)]
        every = shared.all_gather(pieces)
        divisor = self.world_size if self.reduction == "mean" else 1
        for j, (k, _) in enumerate(reps):
            ids = [got[2 * j] for got in every]  # (in rank order; a peer's: views of its file, read by the update)
            if any(x.numel() for x in ids):
                rows[k] = RowParts(ids, [got[2 * j + 1] for got in every], divisor)
                shared.lend(rows[k].own)  # (copied if the transport is called again before the update)
            else:
                rows[k] = None

    def _gather_touched(self, st, pending: RowGrads | None, sizes: list[int]) -> RowGrads:
        """A replica's touched rows from every rank (each row's id and gradient as bytes: copied
        bit for bit), summed per row: (the touched ids ascending, their rows)."""
        dim, cdt, most = st.weight.shape[1], st.compute_dtype, max(sizes)
        width = 8 + dim * _itemsize(cdt)  # (bytes of an id, then of its row)
        buf = torch.zeros(most, width, dtype=torch.uint8, device=st.weight.device)
        if pending is not None and pending.ids.numel():
            n = pending.ids.numel()
            buf[:n, :8] = pending.ids.to(torch.int64).contiguous().view(torch.uint8).view(n, 8)
            buf[:n, 8:] = pending.rows.to(cdt).contiguous().view(torch.uint8).view(n, width - 8)
        out = buf.new_empty(self.world_size * most, width)
        dist.all_gather_single(out, buf, group=self._group)
        got = torch.cat(
            [out[r * most : r * most + c] for r, c in enumerate(sizes)]
        )  # (every rank's rows, rank by rank)
        ids = got[:, :8].contiguous().view(torch.int64).view(-1)
        touched, where = torch.unique(ids, return_inverse=True)  # (ascending: every rank the same)
        grad = torch.zeros(touched.numel(), dim, dtype=cdt, device=buf.device)
        grad.index_add_(0, where, got[:, 8:].contiguous().view(cdt).view(-1, dim))  # (in rank order)
        if self.reduction == "mean":
            grad = grad / self.world_size
        return RowGrads(touched, grad.to(st.weight.dtype))

    def _sync_replica(self, st, pending: RowGrads | None) -> RowGrads | None:
        nrows, dim = st.weight.shape
        buf = torch.zeros(nrows, dim + 1, dtype=st.compute_dtype, device=st.weight.device)  # rows | touched
        if pending is not None:  # (row copies and a fill: measured 1.3 ms less than indexed assignments)
            ids = pending.ids.to(torch.int64)
            buf[:, :dim].index_copy_(0, ids, pending.rows.to(buf.dtype))
            buf[:, dim].index_fill_(0, ids, 1.0)
        dist.all_reduce(buf, group=self._group)
        touched = buf[:, dim].nonzero().squeeze(1)
        if touched.numel() == 0:
            return None
        grad = buf[:, :dim].index_select(0, touched)  # (U, dim) contiguous: the update reads it as is
        if self.reduction == "mean":
            grad.div_(self.world_size)
        return RowGrads(touched, grad.to(st.weight.dtype))

    def _row_statistics(self, where: dict, storages: list, rows: list) -> None:
        """Column slices under a row-wise optimizer: each slice's per-row sum of squares, summed
        over the slices (ranks) of its table, divided by the table's width. Two all-reduces over
        every rank: the rows each table touched (the same for all its slices), then the sums."""
        slices = []  # (table index, storage index, its pending rows of that table, by ascending id)
        counts = torch.zeros(len(self._column_tables), dtype=torch.int64, device=self._device)
        for ti, name in enumerate(self._column_tables):
            route = self._routes[name]
            for pos, (_, s) in enumerate(route.shards):
                if s.rank != self.rank:
                    continue
                local = route.local_name(pos)
                st = self.local.storage_of(local)
                k = where.get(id(st))
                if k is None or rows[k] is None or not getattr(st.optimizer, "row_wise", False):
                    continue
                ids = rows[k].ids
                start = st.row_offset[local]
                sel = ((ids >= start) & (ids < start + self.local.tables[local].num_embeddings)).nonzero().squeeze(1)
                sel = sel.index_select(0, torch.argsort(ids.index_select(0, sel)))  # ascending ids: slices agree
                slices.append((ti, k, sel))
                counts[ti] = sel.numel()
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self._group)
        sizes = counts.tolist()
        if not any(sizes):
            return
        starts = [0, *itertools.accumulate(sizes)]
        sums = torch.zeros(starts[-1], dtype=torch.float64, device=self._device)
        for ti, k, sel in slices:
            sums[starts[ti] : starts[ti + 1]] = storages[k].optimizer.row_stat(
                rows[k].rows.index_select(0, sel).to(torch.float64)
            )
        dist.all_reduce(sums, group=self._group)
        stats: dict[int, torch.Tensor] = {}
        for ti, k, sel in slices:
            grad = rows[k].rows
            if k not in stats:  # rows of other tables in this storage: their own mean square
                stats[k] = storages[k].optimizer.row_stat(grad.to(torch.float64)).div_(grad.shape[1])
            width = self.tables[self._column_tables[ti]].embedding_dim
            stats[k][sel] = sums[starts[ti] : starts[ti + 1]] / width
        for k, stat in stats.items():
            rows[k] = RowGrads(rows[k].ids, rows[k].rows, stat.to(storages[k].compute_dtype))
