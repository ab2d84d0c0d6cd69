"""How the OS backs a program's buffers (modeling/pages.py): with THP_MEM_ALLOC_ENABLE=1 (serve's and
bench's default, a pod's opt-in) a
big tensor is committed in 2 MiB pages (the weights' speed), and the KV pool still 4 KiB at a
time as its blocks are written (its memory is committed by use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# In a fresh interpreter: the allocator reads its setting at its first allocation.
SCRIPT = textwrap.dedent("""
    import json, os
    from inferencemesh.programs.process import prepare_process
    prepare_process("stage")
    import torch
    from inferencemesh.modeling.kv_pool import KVPool

    def committed():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def huge():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages"))

    # 4 layers x 2 x 4 heads: 32 regions of 2,048 blocks x 16 slots x 64 floats (8 MiB each)
    pool = KVPool(4, 0, 4, 64, num_blocks=2048, block_tokens=16, dtype=torch.float32, device=torch.device("cpu"))
    plain = torch.empty(pool.store.shape)
    before = committed()
    pool.store[..., :16, :].fill_(1.0)  # block 0 of every region: 4 KiB each
    pool_grew = committed() - before
    before, huge_before = committed(), huge()
    plain[..., :16, :].fill_(1.0)  # the same writes into a tensor as allocated
    print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "pool": pool_grew,
                      "plain": committed() - before, "plain_huge": huge() - huge_before}))
""")


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="this kernel gives no transparent huge pages")
def test_weights_on_huge_pages_and_the_kv_pool_committed_as_written() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
    assert done.returncode == 0, done.stderr
    grew = json.loads(done.stdout.strip().splitlines()[-1])
    assert grew["env"] == "1"
    # a tensor as PyTorch's allocator gives it after the set-up: 2 MiB pages, so 32 writes of 4 KiB commit 64 MiB
    assert grew["plain_huge"] >= 32 * 2**20 and grew["plain"] >= 32 * 2**20, grew
    # the pool: 32 pages of 4 KiB (and whatever the interpreter allocates on the way)
    assert grew["pool"] < 4 * 2**20, grew
