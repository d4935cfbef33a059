"""The README's and every docs page's Python code blocks run (extracted and executed), so a broken
example fails the tests. Each block runs alone, after a small prelude that defines what the
examples take as given (a ``model``, ``example_inputs``, a few batches, ``tables``), in one
process, under a one-process gloo job for the examples that start one.
A block that cannot run here is marked in the page, on the line above it, with
``<!-- doc-test: skip (why, and which test covers it) -->`` or ``<!-- doc-test: cuda (...) -->``."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import torch

from tests import warm

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<mark>\w+) \((?P<why>[^)]+)\) -->\n)?```python\n(?P<code>.*?)```", re.S)

PRELUDE = textwrap.dedent(
    """
    import os, tempfile, torch, torch.nn as nn, hybridembed as he

    class MyModel(nn.Module):  # what the examples call "model": a small two-tower ranker
        def __init__(self):
            super().__init__()
            self.user, self.item = nn.EmbeddingBag(100, 8, mode="mean"), nn.Embedding(50, 8)
            self.top = nn.Linear(16, 1)

        def forward(self, x):
            users, items = x
            return self.top(torch.cat([self.user(users), self.item(items)], 1)).squeeze(1)

    def _batch(s):
        g = torch.Generator().manual_seed(s)
        return (torch.randint(0, 100, (8, 3), generator=g), torch.randint(0, 50, (8,), generator=g)), torch.rand(8, generator=g)

    model = MyModel()
    example_inputs = (_batch(0)[0],)
    my_part_of_the_data = my_shard_of_the_data = [_batch(s) for s in range(3)]
    batches_from = lambda step: my_part_of_the_data[step % 3:]
    loss_fn = nn.functional.binary_cross_entropy_with_logits
    tables = [he.TableConfig("user", 1000, 8), he.TableConfig("item", 500, 8)]
    os.chdir(tempfile.mkdtemp())
    path = CKPT = "ckpt"
    """
)

# what a page's examples take as already done, beyond the prelude
GIVEN = {
    "docs/checkpoints.md": "model = he.convert(model)\nopt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)\n",
    "docs/optimizers.md": "model = he.convert(model)\n",
}

RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    import torch.distributed as dist
    blocks = json.loads(open(sys.argv[1]).read())
    failures = []
    for where, code, prelude in blocks:
        scope = {}
        try:
            exec(compile(prelude, "<prelude>", "exec"), scope)
            exec(compile(code, where, "exec"), scope)
        except Exception:
            failures.append(f"the block at {where}:\\n{traceback.format_exc(limit=4)}")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    print(json.dumps(failures))
    """
)


def _blocks(page: str) -> list[tuple[int, str | None, str, str]]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start("code")) + 1, m.group("mark"), m.group("why") or "", m.group("code"))
        for m in BLOCK.finditer(text)
    ]


def test_every_python_block_is_run_or_says_why_not():
    for page in PAGES:
        for line, mark, why, _ in _blocks(page):
            assert mark in (None, "skip", "cuda"), f"{page}:{line}: unknown doc-test mark {mark!r}"
            assert mark is None or len(why) > 10, f"{page}:{line}: say why the block is not run here"


def test_the_pages_python_examples_run(tmp_path):
    """Every page's runnable blocks, in one process (a page's blocks do not share names: each block
    runs after the prelude and the page's givens alone)."""
    gpu = torch.cuda.is_available()
    blocks = [
        (f"{page}:{line}", code, PRELUDE + GIVEN.get(page, ""))
        for page in PAGES
        for line, mark, _, code in _blocks(page)
        if mark is None or (mark == "cuda" and gpu)
    ]
    assert len(blocks) >= 10  # (the README's and the docs' examples were found)
    from hybridembed.launch import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    # (a process of its own, forked warm: torch and hybridembed imported, nothing else run)
    rc, out, err = warm.run_code(RUNNER, env, cwd=tmp_path, timeout=300, argv=[str(tmp_path / "blocks.json")])
    assert rc == 0, err[-3000:]
    failures = json.loads(out.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)
