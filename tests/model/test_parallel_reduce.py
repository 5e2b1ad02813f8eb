"""The deterministic mode's all-reduce: three gloo ranks in real processes sum a row-parallel
layer's parts in rank order, so a row's sum has the same bits whatever the step's row count."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkserve.bench.service import free_port
from chunkserve.model.parallel import ParallelContext

WORLD = 3
ROW_COUNTS = (1, 2, 3, 17, 100, 333, 1024)
HIDDEN = 96


def rank_part(rank: int) -> torch.Tensor:
    """Rank `rank`'s partial outputs for 1024 rows, of mixed magnitudes (so the order of the sum matters)."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(max(ROW_COUNTS), HIDDEN, generator=generator) * 10.0 ** torch.randint(-3, 4, (1, HIDDEN),
                                                                                              generator=generator)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        context = ParallelContext(tp_rank=rank, tp_size=WORLD, tp_ranks=tuple(range(WORLD)), fixed_order_reduce=True)
        sums = {rows: context.all_reduce(rank_part(rank)[:rows].clone()) for rows in ROW_COUNTS}
        torch.save(sums, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_rank_order_sum_whatever_the_row_count(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    parts = [rank_part(rank) for rank in range(WORLD)]
    expected = parts[0].clone()
    for part in parts[1:]:
        expected.add_(part)
    for rank in range(WORLD):
        sums = torch.load(tmp_path / f"{rank}.pt")
        for rows, total in sums.items():
            assert torch.equal(total, expected[:rows]), (rank, rows)
