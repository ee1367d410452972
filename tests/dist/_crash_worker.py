"""The launch of tests/dist/test_train_parity.py `test_a_crashing_rank_fails_fast`, through the same
`_rank.serve` as every case worker: rank 1 raises in its case, rank 0 waits in a gloo barrier for a
peer that never comes (the harness must kill it, not wait for the group's timeout). Only the launch
is under test, so the ranks import no model code (torch.distributed alone)."""
import torch.distributed as dist
from _rank import serve


def run_case(case: dict, rank: int, world: int) -> dict:
    if rank == 1:
        raise RuntimeError("rank 1 crashes on purpose")
    dist.barrier()  # rank 0 waits here for a peer that never comes
    return {}


if __name__ == "__main__":
    serve(run_case)
