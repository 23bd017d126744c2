"""Sharded models as people train them today: FSDP2 (``fully_shard``), HSDP and FSDP2 + TP on
gloo ranks, restored into a freshly built optimizer at other world sizes.

Each saved run's full state is also kept through torch's own API (DCP's ``get_state_dict``);
a restore must reproduce it exactly, give every optimizer state its parameter's placement,
and take the next step bit-identically to a twin (the uninterrupted run at the saved world
size; elsewhere one loaded by torch's ``set_state_dict``).
"""

import pytest

from .launch import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """mode -> arguments of its saved run (made once per mode, on first use)."""
    runs: dict[str, dict] = {}

    def get(mode: str, world: int) -> dict:
        if mode not in runs:
            d = tmp_path_factory.mktemp(mode)
            args = {"root": str(d / "ckpt"), "reference": str(d / "reference.pt"), "steps": STEPS, "mode": mode,
                    "saved_world": world}
            run_ranks("save", world, args, module="tests.fsdp_workers", env={"FORCE_DIST": "1"}, timeout=120)
            runs[mode] = args
        return runs[mode]

    return get


def resume(args: dict, world: int) -> None:
    results = run_ranks("resume", world, args, module="tests.fsdp_workers", env={"FORCE_DIST": "1"}, timeout=120)
    for r in results:
        assert f"resumed {args['mode']} at world {world}" in r.output, r.output[-2000:]


@pytest.mark.parametrize("world", [2, 1, 3])
def test_fsdp2_saved_by_2_resumes_with_a_fresh_optimizer(saved, world):
    resume(saved("fsdp", 2), world)


@pytest.mark.parametrize("world", [4, 2])
def test_hsdp_saved_by_4_resumes(saved, world):
    resume(saved("hsdp", 4), world)


@pytest.mark.parametrize("world", [4, 2])
def test_fsdp2_with_tensor_parallel_saved_by_4_resumes(saved, world):
    resume(saved("fsdp_tp", 4), world)
