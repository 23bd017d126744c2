"""Bad input gets one clear error and changes nothing."""

import os

import numpy as np
import pytest
import torch

from resilient import Checkpointer, CommitError, StateError, StorageError, UnsupportedStateError


def test_unwritable_root_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StorageError) as err:
        Checkpointer(str(blocker / "ckpt"))
    assert str(blocker / "ckpt") in str(err.value)


class _Place(os.PathLike):
    """A path-like object of a program's own (not a pathlib path, which is saved)."""

    def __init__(self, where):
        self.where = where

    def __fspath__(self):
        return self.where


def test_non_serialisable_value_names_the_key_and_writes_nothing(root):
    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"extra/hook.*function"):
            ckpt.save(1, {"w": torch.ones(2), "extra": {"hook": lambda: 0}})
        with pytest.raises(UnsupportedStateError, match="object"):
            ckpt.save(1, {"w": object()})
        # numpy's arrays of numbers are saved (test_roundtrip); of strings or objects they are
        # refused by path, with the plain value that keeps them
        with pytest.raises(UnsupportedStateError, match=r"state\['meta/names'\]: a numpy array of dtype <U1 .*"
                                                        r"array.tolist\(\)"):
            ckpt.save(1, {"w": torch.ones(2), "meta": {"names": np.array(["a", "b"])}})
        with pytest.raises(UnsupportedStateError, match=r"state\['meta/objs'\]: a numpy array of dtype object"):
            ckpt.save(1, {"w": torch.ones(2), "meta": {"objs": np.array([None, 1])}})
        with pytest.raises(UnsupportedStateError, match=r"state\['meta/name'\]: .*numpy.datetime64 .*value.item\(\)"):
            ckpt.save(1, {"w": torch.ones(2), "meta": {"name": np.datetime64("2026-12-06")}})
        # values a config or sampler holds, each with the plain value that keeps it whole
        # (was the same generic remedy for all of them)
        # (was the same generic remedy for all of them; paths, dates and dtypes are saved now)
        for value, instead in [(_Place("/data/shard-3"), r"str\(value\)"),
                               ({(3, 1)}, r"a set of numbers and strings, or sorted\(value\)")]:
            with pytest.raises(UnsupportedStateError, match=rf"state\['cfg/x'\]: .*; store {instead}"):
                ckpt.save(1, {"w": torch.ones(2), "cfg": {"x": value}})
        # an int key and its text: both keys as given, and the name they share (was "'1' and '1'")
        with pytest.raises(UnsupportedStateError, match=r"state\['meta'\]: keys 1 and '1' are both named 'meta/1'"):
            ckpt.save(1, {"w": torch.ones(2), "meta": {1: "a", "1": "b"}})
        ckpt.wait()
        assert ckpt.latest() is None
    assert [n for n in os.listdir(root) if not n.startswith(".")] == []


class _NoStateYet:
    """An object with ``state_dict`` that cannot give its state in this configuration, as
    accelerate's prepared DataLoader without ``use_stateful_dataloader``."""

    def state_dict(self):
        raise AttributeError("'DataLoader' object has no attribute 'dl_state_dict'")

    def load_state_dict(self, state):
        pass


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes on exceptions: Python 3.11+")
def test_an_error_raised_by_a_state_dict_names_the_entry_and_keeps_its_type(root):
    with Checkpointer(root) as ckpt:
        with pytest.raises(AttributeError, match="dl_state_dict") as err:
            ckpt.save(1, {"w": torch.ones(2), "loaders": {"train": _NoStateYet()}})
        assert err.value.__notes__ == [
            "resilient: raised by _NoStateYet.state_dict() of state['loaders/train'], which is being saved (pass "
            "what that object can give instead, or leave it out)"]
        assert ckpt.latest() is None


def test_every_dtype_torch_has_is_one_the_format_knows_by_size():
    """The format's dtype table is written out (so that reading a manifest needs no torch):
    a torch that adds a dtype fails here, not in a user's restore."""
    from resilient._format import DTYPE_ITEMSIZE, dtype_from_name

    torchs = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert {name: d.itemsize for name, d in torchs.items()} == DTYPE_ITEMSIZE
    assert all(dtype_from_name(name) is torchs[name] for name in DTYPE_ITEMSIZE)


def test_a_dtype_the_format_does_not_know_is_refused_at_save_naming_the_key(root, monkeypatch):
    """As a newer torch's dtype would be: refused before anything is written, not saved
    into a checkpoint that no restore could read."""
    from resilient import _tree

    monkeypatch.setattr(_tree, "_SAVABLE_DTYPES", _tree._SAVABLE_DTYPES - {torch.float16})
    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"state\['model/half'\]: dtype torch.float16 is not one"):
            ckpt.save(1, {"model": {"w": torch.ones(2), "half": torch.ones(2, dtype=torch.float16)}})
        ckpt.wait()
        assert ckpt.latest() is None
    assert [n for n in os.listdir(root) if not n.startswith(".")] == []


class _Wrapper(torch.Tensor):
    """A wrapper subclass (as torchao's quantized weights are): no storage of its own."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "_Wrapper":
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapper) else x  # noqa: E731
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


_NO_PLAIN_BYTES = {
    # A quantized tensor's copy crashed the whole process (SIGSEGV) before it was refused.
    "quantized": (lambda: torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 0, torch.qint8),
                  "quantized tensor.*int_repr"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)]), "nested tensor.*unbind"),
    "meta": (lambda: torch.empty(3, 4, device="meta"), "meta device and has no data.*to_empty"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "layout torch.sparse_csr.*dense"),
    "wrapper": (lambda: _Wrapper(torch.ones(3)), "_Wrapper, a tensor subclass without storage"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", sorted(_NO_PLAIN_BYTES))
def test_a_tensor_without_plain_bytes_is_refused_at_save_naming_the_key(root, kind):
    make, why = _NO_PLAIN_BYTES[kind]
    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=rf"state\['extra/odd'\]: it .*{why}"):
            ckpt.save(1, {"model": torch.nn.Linear(2, 2), "extra": {"odd": make()}})
        ckpt.wait()
        assert ckpt.latest() is None
    assert [n for n in os.listdir(root) if not n.startswith(".")] == []


def test_a_tensor_whose_storage_was_freed_is_refused_at_save_naming_the_key(root):
    """As FSDP frees an unsharded parameter after forward: copying from it read freed memory."""
    freed = torch.randn(4, 4)
    freed.untyped_storage().resize_(0)
    with Checkpointer(root) as ckpt:
        with pytest.raises(UnsupportedStateError, match=r"state\['model/w'\]: its storage holds 0 bytes, fewer "
                                                        r"than the 64 its shape \[4, 4\] needs .*resize_\(0\)"):
            ckpt.save(1, {"model": {"w": freed}})
        with pytest.raises(CommitError, match="step 1 was not committed.*its storage holds 0 bytes"):
            ckpt.wait()  # found in the copy, once the save was under way: it fails as a save
        assert ckpt.latest() is None
    assert [n for n in os.listdir(root) if not n.startswith(".")] == []


@pytest.fixture
def saved(root):
    model = torch.nn.Linear(4, 3)
    with Checkpointer(root) as ckpt:
        ckpt.save(5, {"model": model, "extra": torch.arange(4.0)})
    return root


def test_missing_key_is_named(saved):
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError, match=r"key 'optim' is not in the checkpoint of step 5"):
            ckpt.restore({"model": torch.nn.Linear(4, 3), "optim": {}})


def test_shape_mismatch_names_key_and_shapes_and_changes_nothing(saved):
    wrong = torch.nn.Linear(4, 5)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    extra = torch.zeros(4)
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError) as err:
            ckpt.restore({"extra": extra, "model": wrong})
    msg = str(err.value)
    assert "model/" in msg and "[5, 4]" in msg and "[3, 4]" in msg
    assert all(torch.equal(v, before[k]) for k, v in wrong.state_dict().items())
    assert torch.equal(extra, torch.zeros(4))  # checked before anything was read


def test_dtype_mismatch_is_named(saved):
    # floating point into floating point converts (test_dtype_conversion); into integers not
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError, match=r"key 'extra'.*int64.*float32.*floating-point dtypes"):
            ckpt.restore({"extra": torch.zeros(4, dtype=torch.int64)})


def test_module_with_missing_entries_is_refused(saved):
    smaller = torch.nn.Linear(4, 3, bias=False)
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError, match="model/bias"):
            ckpt.restore({"model": smaller})


def test_bad_arguments(root):
    with pytest.raises(ValueError, match="compress"):
        Checkpointer(root, compress="lz4")
    with pytest.raises(ValueError, match="every"):
        Checkpointer(root, every=0)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(root, keep=0)
    with Checkpointer(root) as ckpt:
        with pytest.raises(ValueError, match="step"):
            ckpt.save(-1, {"x": torch.ones(1)})
        with pytest.raises(ValueError, match="needs a state"):
            ckpt.save(1)


def test_restoring_into_a_module_on_the_meta_device_is_refused_naming_the_key(saved):
    """Before, the copy into a meta tensor did nothing and restore reported step 5 restored:
    the model stayed without weights."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError, match=r"key 'model/weight': .*meta device.*to_empty"):
            ckpt.restore({"model": model})
        model.to_empty(device="cpu")
        assert ckpt.restore({"model": model}) == 5
    expected = torch.nn.Linear(4, 3)
    with Checkpointer(saved) as ckpt:
        ckpt.restore({"model": expected})
    assert torch.equal(model.weight, expected.weight) and torch.equal(model.bias, expected.bias)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_restoring_into_a_quantized_tensor_is_refused_naming_the_key(saved):
    target = torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError, match=r"key 'extra': .*quantized tensor"):
            ckpt.restore({"extra": target})


def test_restoring_into_a_tensor_whose_storage_was_freed_is_refused_naming_the_key(saved):
    """Before, the reads into its null pointer left it empty and restore reported step 5
    restored. Once its storage is allocated again, the same restore fills it."""
    model = torch.nn.Linear(4, 3)
    storage = model.weight.untyped_storage()
    storage.resize_(0)  # as FSDP frees an unsharded parameter after forward
    with Checkpointer(saved) as ckpt:
        with pytest.raises(StateError, match=r"key 'model/weight': .*its storage holds 0 bytes, fewer than the "
                                             r"48 its shape \[3, 4\] needs .*resize_\(0\)"):
            ckpt.restore({"model": model})
        storage.resize_(48)
        assert ckpt.restore({"model": model}) == 5
    expected = torch.nn.Linear(4, 3)
    with Checkpointer(saved) as ckpt:
        ckpt.restore({"model": expected})
    assert torch.equal(model.weight, expected.weight)



def test_restoring_into_an_expanded_buffer_is_refused_naming_the_key_before_anything_is_read(root):
    """A buffer made by ``expand`` (``position_ids`` in older transformer code) shares one
    memory location among its elements: torch's ``load_state_dict`` cannot copy into it
    either, and the restore raised torch's "unsupported operation" naming nothing, after
    reading. A transposed or strided one is no such view and restores."""
    saved = {"ids": torch.arange(10).expand(3, -1).clone(), "t": torch.arange(12.0).reshape(3, 4).t(),
             "s": torch.arange(20.0)[::3]}
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": saved}).result()
    back = {"ids": torch.zeros(10, dtype=torch.long).expand(3, -1), "t": torch.zeros(3, 4).t(), "s": torch.zeros(20)[::3]}
    with Checkpointer(root) as ckpt:
        with pytest.raises(StateError, match=r"key 'model/ids': .*expanded view \(stride 0 along dim 0.*persistent=False"):
            ckpt.restore({"model": back})
        back["ids"] = back["ids"].clone()
        assert ckpt.restore({"model": back}) == 1
    assert all(torch.equal(back[k], saved[k]) for k in saved)

def test_a_checkpointer_made_before_the_process_group_under_a_launcher_is_refused(root, monkeypatch):
    """torchrun and resilient-run set WORLD_SIZE: made before init_process_group, every rank's
    Checkpointer saved as if alone into the same root, and one of them failed at random with
    errors about another job holding the root or a directory that is not empty."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"Checkpointer made on rank 1 of WORLD_SIZE=2 before "
                                           r"torch.distributed.init_process_group\(\)"):
        Checkpointer(root)
    assert not os.path.exists(os.path.join(root, ".lock"))
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank: alone, as before
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}).result()


def test_bad_arguments_are_refused_naming_the_argument(root, tmp_path):
    """Each names its argument and the value given; before, commit_timeout=-1 and
    direct_io="yes" were taken, keep_remote=0 was refused as "keep", and a mistyped URL
    ("s3//bucket/run") was taken as a local directory: uploads went to ./s3/bucket/run on
    each node's own disk."""
    for kwargs, message in (({"keep_remote": 0}, "keep_remote must be a positive integer"),
                            ({"keep": True}, "keep must be a positive integer"),
                            ({"commit_timeout": -1}, r"commit_timeout \(argument or RESILIENT_COMMIT_TIMEOUT\) must "
                                                     r"be a number of seconds > 0, got -1"),
                            ({"direct_io": "yes"}, "direct_io must be True, False or None, got 'yes'"),
                            ({"remote": "s3//bucket/run"}, r"remote='s3//bucket/run' looks like a mistyped URL"),
                            ({"remote": "gs:bucket/run"}, r"remote='gs:bucket/run' looks like a mistyped URL")):
        with pytest.raises(ValueError, match=message):
            Checkpointer(root, **kwargs)
    assert not os.path.exists("s3")
    # root is the node's own disk: "" (an unset variable) saved into the working directory,
    # and a URL into ./s3:/bucket/run, both without a word
    for bad, message in (("", "root must name a directory on the node's disk, got ''"),
                         ("s3://bucket/run", r"root='s3://bucket/run' is a URL: .* remote='s3://bucket/run'"),
                         ("s3//bucket/run", r"root='s3//bucket/run' looks like a mistyped URL")):
        with pytest.raises(ValueError, match=message):
            Checkpointer(bad, state={"w": torch.ones(2)})
    assert not os.path.exists("s3:") and not os.path.exists(".lock")
    # above the format's 1 GiB chunks, every checkpoint was written, then refused as damaged
    # (restore returned 0); strict="no" was taken as true; a list as the state failed at save
    for kwargs, message in (({"chunk_bytes": 2**31}, r"chunk_bytes must be an integer from 4096 to 1073741824"),
                            ({"strict": "no"}, "strict must be True or False, got 'no'"),
                            ({"rng": 1}, "rng must be True or False, got 1"),
                            ({"every_seconds": "60"}, "every_seconds must be a number of seconds, got '60'"),
                            ({"state": [torch.ones(2)]}, "state must be a mapping of names to objects, got list")):
        with pytest.raises(ValueError, match=message):
            Checkpointer(root, **kwargs)
    # a directory, as a path or a string, is a remote tier (a shared filesystem)
    with Checkpointer(root, remote=tmp_path / "shared") as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        ckpt.flush(timeout=60)
    assert Checkpointer(str(tmp_path / "other"), remote=str(tmp_path / "shared")).latest() == 1


@pytest.mark.parametrize("name, value", [("RESILIENT_PREEMPT_GRACE", "2m"), ("RESILIENT_FLUSH_TIMEOUT", "abc"),
                                         ("RESILIENT_DIRECT_IO", "maybe"), ("RESILIENT_HANG_TIMEOUT", "-1"),
                                         ("RESILIENT_PREEMPT", "disable")])
def test_a_malformed_setting_in_the_environment_is_refused_by_name(root, monkeypatch, name, value):
    """Before, a preemption grace of "2m" fell back to 25 s without a word (found out at the
    signal), and RESILIENT_PREEMPT=false left preemption on: only "0" turned it off."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"environment variable {name}={value!r}"):
        Checkpointer(root, state={"w": torch.ones(2)})
