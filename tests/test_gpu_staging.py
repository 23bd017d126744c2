"""Staging on a GPU (run where one is: `benchmarks/gpu_staging.sh` runs these first on the
device machine; skipped elsewhere). The staging buffer is page-locked at exactly its size
(not rounded up to a power of two by torch's pinned allocator), and what an overlapped
save commits, written as the side stream's copy comes, is exactly the state at ``save``
although the optimizer step after it runs at once; restored into CUDA tensors (each copied
to the device by the read that completes it), it comes back exact."""

from __future__ import annotations

import pytest
import torch

from resilient import Checkpointer
from resilient._fence import CopyProgress
from resilient._hostmem import HostBuffer

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_staging_buffer_is_locked_at_exactly_its_size():
    nbytes = (96 << 20) + 4096 * 3 + 100  # just over a power of two: torch would lock 128 MiB
    memory = HostBuffer(nbytes, pin=True)
    assert memory.tensor.numel() == nbytes and memory.tensor.data_ptr() % 4096 == 0
    assert memory.tensor.is_pinned()
    assert memory.registered, "registration failed: the fallback (torch's allocator) was used"
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    memory.tensor.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(memory.tensor, source.cpu())
    memory.release()
    assert not memory.registered


def _build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()  # 128 MiB of weights
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim


def _step(model, optim, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(64, 2048, device="cuda", generator=g)).square().mean().backward()
    optim.step()


def _flat(model, optim) -> dict[str, torch.Tensor]:
    out = {f"p/{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        out.update({f"o/{pid}/{k}": v.detach().cpu().clone() for k, v in st.items()})
    return out


def test_an_overlapped_save_of_gpu_state_commits_the_state_at_save(tmp_path):
    root = str(tmp_path / "ckpt")
    model, optim = _build()
    _step(model, optim, 0)
    expected = {}
    with Checkpointer(root, state={"model": model, "optim": optim}, keep=None, rng=False) as ckpt:  # auto: overlap
        for step in (1, 2):
            _step(model, optim, step)
            expected[step] = _flat(model, optim)
            handle = ckpt.save(step)
            assert handle.deferred_bytes > 3 * CopyProgress.EVENT_BYTES  # several events for the writer
            _step(model, optim, 100 + step)  # the step after: its optimizer step waits for the copy
        ckpt.wait()
    for step in (1, 2):
        fresh, fresh_optim = _build()
        _step(fresh, fresh_optim, 7)
        with Checkpointer(root, state={"model": fresh, "optim": fresh_optim}, rng=False) as ckpt:
            assert ckpt.restore(step=step) == step
        got = _flat(fresh, fresh_optim)
        for name, value in expected[step].items():
            assert torch.equal(got[name], value), (step, name)


def test_the_preemption_vote_on_nccl_is_read_a_call_late_without_a_host_sync(tmp_path, monkeypatch):
    """On an NCCL group the vote's answer is copied to pinned memory after the collective and
    read at the next call through an event: the answer of the previous call's values, and
    reading it does not wait for work queued after that call."""
    import torch.distributed as dist

    from resilient._coord import GroupCoordinator
    from resilient._local import LocalTier

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29581")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        tier = LocalTier(str(tmp_path))
        tier.prepare()
        coord = GroupCoordinator(None, tier)
        assert coord.agree_max_later([3]) is None
        busy = torch.randn(4096, 4096, device="cuda")
        assert coord.agree_max_later([5]) == [3]
        for _ in range(20):  # long device work queued after the vote of [5]
            busy = busy @ busy / 4096
        started = torch.cuda.Event(enable_timing=False)
        started.record()
        assert coord.agree_max_later([0]) == [5]
        assert not started.query(), "the answer was read only once the device was idle"
    finally:
        dist.destroy_process_group()
