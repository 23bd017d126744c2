import resilient


def test_public_surface_is_pinned():
    assert sorted(resilient.__all__) == sorted(
        [
            "Checkpointer",
            "SaveHandle",
            "ResilientError",
            "StateError",
            "UnsupportedStateError",
            "CheckpointCorruptError",
            "CommitError",
            "StorageError",
            "AnyOf",
            "EveryNSteps",
            "EveryNSeconds",
            "KeepLast",
            "KeepEvery",
            "elastic",
            "PeerFailure",
            "HangError",
            "GangChange",
            "PerRank",
        ]
    )
    for name in resilient.__all__:
        assert getattr(resilient, name) is not None


def test_errors_are_rooted_in_builtins():
    assert issubclass(resilient.ResilientError, Exception)
    assert issubclass(resilient.StateError, ValueError)
    assert issubclass(resilient.UnsupportedStateError, TypeError)
    assert issubclass(resilient.StorageError, OSError)
    err = resilient.CommitError(7, {1: "disk full", 0: "peer gone"})
    assert err.failures == {0: "peer gone", 1: "disk full"}
    assert "step 7" in str(err) and "rank 1: disk full" in str(err)


def test_importing_resilient_leaves_dtensor_unloaded():
    """Every worker and agent imports resilient at start, and a recovery restarts them:
    DTensor's module (~1 s here, sympy through torch.fx) is looked up, never imported."""
    import subprocess
    import sys

    code = ("import sys, resilient, resilient.launch.run, resilient.ckpt; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
