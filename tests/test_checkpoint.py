"""Checkpoints, resharding and recovery from faults, against independent references: one process
training on the global batch (tests/reference.py, computed in the test process, with a plain torch
optimizer), and the same engine trained without interruption. float64 where exactness matters."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import zerolab
from helpers import assert_params
from reference import build, rank_batch, reference, run, train as train_engine
from zerolab import checkpoint
from zerolab.checkpoint import CheckpointError
from zerolab.stages import parse_stage

GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=8)
LR = 1e-2
EXACT = dict(rtol=1e-10, atol=1e-12)
# Every step's global batch: 12 one-sample data shards, split evenly over 1, 2, 3 or 4 ranks, so
# that it is the same data whatever N is (the reference is "12 ranks" of one sample each).
SHARDS = 12
DATA = dict(size=1, model_kw=GPT)
LOOP = dict(DATA, shards=SHARDS, lr=LR)


def _check(results, expected, what, exact=False):
    assert_params(results, expected, what, exact=exact, **({} if exact else EXACT))


def train(spec, until, *, load=None, save_at=None, path=None, fault=None, **kw):
    """On every rank: build the engine of ``spec`` ('2', '3+offload'), optionally load ``load``,
    train up to step ``until`` (saving to ``path`` after step ``save_at``), return the full state
    dict. ``fault=(step, rank, kind)`` misbehaves."""
    stage, offload = parse_stage(spec)
    rank = dist.get_rank()

    def load_it(engine):
        client = engine.load_checkpoint(load)
        assert client == {"data_position": engine.steps}, client

    def misbehave(engine, step):
        if fault[:2] != (step, rank):
            return None
        if fault[2] == "raise":
            raise RuntimeError(f"injected failure at step {step}")
        if fault[2] == "kill":                          # the others are in the forward/backward
            os.kill(os.getpid(), signal.SIGKILL)        # collectives when this lands
        if fault[2] == "skip":
            return "skipped"                            # never joins this step's collectives
        return None

    def save(engine, step):
        if save_at == step + 1:
            engine.save_checkpoint(path, client_state={"data_position": step + 1})

    return train_engine("gpt", until, stage=stage, offload=offload, **LOOP, setup=load_it if load else None,
                        before_step=misbehave if fault else None, after_step=save if save_at else None, **kw)


@pytest.fixture(scope="module")
def ref():
    """ONE process, no communication: AdamW on each step's global batch. {step: state dict}."""
    return {steps: reference("gpt", SHARDS, steps, lr=LR, **DATA) for steps in (5, 10)}


def test_save_4_ranks_stage3_resume_2_ranks_stage1(clusters, ref, tmp_path):
    """The issue's case: save at step 5 on 4 ranks at stage 3, resume on 2 ranks at stage 1, compare
    at step 10 with one process that never stopped; and the consolidated checkpoint is step 5's."""
    path = str(tmp_path / "ckpt")
    _check(clusters(4).run(train, 3, 5, save_at=5, path=path), ref[5], "4 ranks stage 3, step 5")
    meta = checkpoint.read_metadata(path)
    assert (meta["stage"], meta["world_size"], meta["steps"]) == (3, 4, 5)
    assert len(meta["files"]) == 4 and all(len(f["sha256"]) == 64 for f in meta["files"])
    # the state dict names both ends of a tied weight (head.weight is tok.weight): so does ref
    _check([checkpoint.consolidate(path)], ref[5], "consolidated, no process group")
    _check(clusters(2).run(train, 1, 10, load=path), ref[10], "2 ranks stage 1 from the checkpoint, step 10")


@pytest.mark.parametrize("saved, resumed", [((2, "0"), (3, "2")), ((3, "2+offload"), (4, "0")),
                                            ((1, "1"), (2, "3+offload")), ((4, "1+offload"), (1, "3"))])
def test_any_world_size_and_stage_to_any_other(clusters, ref, tmp_path, saved, resumed):
    path = str(tmp_path / "ckpt")
    clusters(saved[0]).run(train, saved[1], 5, save_at=5, path=path)
    _check(clusters(resumed[0]).run(train, resumed[1], 10, load=path), ref[10],
                  f"saved {saved}, resumed {resumed}, step 10")


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["0", "1", "2", "3", "1+offload", "2+offload", "3+offload"])
def test_resume_on_the_same_ranks_is_bit_identical(clusters, tmp_path, spec, param_dtype):
    """Same configuration: stopping and resuming must not change a single bit (fp32 masters and
    the optimizer state are restored exactly; the compute copies are re-derived from them)."""
    path = str(tmp_path / "ckpt")
    kw = dict(dtype=torch.float32, param_dtype=param_dtype)
    straight = clusters(2).run(train, spec, 6, **kw)
    clusters(2).run(train, spec, 3, save_at=3, path=path, **kw)
    _check(clusters(2).run(train, spec, 6, load=path, **kw), straight[0], f"stage {spec}", exact=True)


def _rewind(spec, options, path):
    """Train to step 6 saving after step 3, then load step 3 INTO THE SAME ENGINE (its optimizer
    state exists; stage 3's kept units are gathered) and train to 6 again. Returns both results."""
    stage, offload = parse_stage(spec)

    def save_at_3(engine, step):
        if engine.steps == 3:
            engine.save_checkpoint(path)

    def rewind(engine):
        straight = engine.full_state_dict()
        with torch.no_grad():                           # an evaluation: stage 3 gathers its kept units
            engine(*rank_batch("gpt", 0, dist.get_rank(), dist.get_world_size(), shards=SHARDS, **DATA))
        engine.load_checkpoint(path)
        assert engine.steps == 3
        run(engine, "gpt", 6, dtype=torch.float32, shards=SHARDS, **DATA)
        return straight, engine.full_state_dict()

    return train_engine("gpt", 6, stage=stage, offload=offload, dtype=torch.float32, **LOOP,
                        after_step=save_at_3, finish=rewind, **options)


@pytest.mark.parametrize("spec, options", [("0", {}), ("1", {}), ("2", {}), ("3", {}), ("2+offload", {}),
                                           ("3", {"persist_numel": 10 ** 9})], ids=str)
def test_loading_into_a_trained_engine_rewinds_it_exactly(clusters, tmp_path, spec, options):
    for rank, (straight, rewound) in enumerate(clusters(2).run(_rewind, spec, options, str(tmp_path))):
        assert_params([rewound], straight, f"rank {rank}, stage {spec} {options}, rewound to 3", exact=True)


def _load_during_delayed_update(path):
    """Offload with the delayed parameter update: a host update still running in the background
    when load() is called must not overwrite the loaded state afterwards."""
    def then(engine):
        engine.save_checkpoint(path, client_state={"data_position": 2})
        saved = engine.full_state_dict()
        engine.delayed_update = True
        inner = engine.shard_optim.optimizer
        slow_step = inner.step

        def slow(*args, **kwargs):                      # the host update takes a while
            time.sleep(1.0)
            return slow_step(*args, **kwargs)
        inner.step = slow
        engine.backward(engine(*rank_batch("gpt", 2, dist.get_rank(), dist.get_world_size(), shards=SHARDS,
                                           **DATA)))
        engine.step()                                   # returns at once; the update runs on
        engine.load_checkpoint(path)
        time.sleep(1.5)                                 # a late update would land by now
        return saved, engine.full_state_dict(), engine.steps

    return train_engine("gpt", 2, stage=2, offload="optimizer", dtype=torch.float32, **LOOP, finish=then)


@pytest.mark.parametrize("spec", ["1+offload", "2+offload", "3+offload"])
def test_saving_during_a_delayed_update_changes_nothing_and_resumes_the_same_run(clusters, tmp_path, spec):
    """Offload's delayed parameter update (one update stale) from the first step: saving after step
    3 must not change steps 4-6 (it used to apply the pending update: 9.5e-3 apart after 3 steps),
    and a run loaded from that checkpoint with the delayed update on must continue the same
    trajectory, bit for bit, against the uninterrupted run (which tests/test_offload.py checks
    against the single-process stale reference)."""
    path = str(tmp_path / "ckpt")
    kw = dict(dtype=torch.float32, delayed=True)
    straight = clusters(2).run(train, spec, 6, **kw)
    saving = clusters(2).run(train, spec, 6, save_at=3, path=path, **kw)
    _check(saving, straight[0], f"{spec}: saved at step 3 along the way", exact=True)
    assert checkpoint.read_metadata(path)["pending_update"] is True
    _check(clusters(2).run(train, spec, 6, load=path, **kw), straight[0], f"{spec}: resumed from step 3",
           exact=True)


def test_load_waits_for_a_delayed_host_update(clusters, tmp_path):
    for rank, (saved, loaded, steps) in enumerate(clusters(2).run(_load_during_delayed_update, str(tmp_path))):
        assert steps == 2
        assert_params([loaded], saved, f"rank {rank}: loaded during a delayed update", exact=True)


def test_consolidated_state_loads_into_the_plain_model(clusters, tmp_path, capsys):
    path = tmp_path / "ckpt"
    clusters(2).run(train, "2", 2, save_at=2, path=str(path))
    state = checkpoint.consolidate(path)
    model = build("gpt", model_kw=GPT)
    model.load_state_dict(state)                       # strict: every name, tied ones included
    assert model.tok.weight is model.head.weight and torch.equal(model.head.weight, state["tok.weight"])
    out = tmp_path / "model.pt"
    assert checkpoint.main([str(path), str(out)]) == 0
    assert "stage 2 on 2 ranks at step 2" in capsys.readouterr().out
    assert all(torch.equal(torch.load(out)[k], v) for k, v in state.items())


# -- damaged checkpoints: a clear error naming the file, never a partial load --------------------
@pytest.fixture(scope="module")
def saved(clusters, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    clusters(2).run(train, "3", 2, save_at=2, path=str(path))
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst, checkpoint.read_metadata(dst)["files"]


def test_an_edited_metadata_file_is_refused(saved, tmp_path):
    import json
    path, _ = _copy(saved, tmp_path / "edited")
    meta = json.loads((path / checkpoint.METADATA).read_text())
    meta["steps"] = 50                                  # a step count changed by hand
    (path / checkpoint.METADATA).write_text(json.dumps(meta, indent=1))
    with pytest.raises(CheckpointError, match="metadata.json does not match its own SHA-256 checksum"):
        checkpoint.consolidate(path)
    del meta["checksum"]
    (path / checkpoint.METADATA).write_text(json.dumps(meta, indent=1))
    with pytest.raises(CheckpointError, match=r"lacks \['checksum'\]"):
        checkpoint.read_metadata(path)


def test_missing_truncated_or_altered_shard_is_named(saved, tmp_path):
    path, files = _copy(saved, tmp_path / "missing")
    (path / files[1]["name"]).unlink()
    with pytest.raises(CheckpointError, match=rf"{files[1]['name']} \(rank 1's shard\) is missing"):
        checkpoint.consolidate(path)

    path, files = _copy(saved, tmp_path / "truncated")
    shard = path / files[0]["name"]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{files[0]['name']} is truncated"):
        checkpoint.consolidate(path)

    path, files = _copy(saved, tmp_path / "altered")
    shard = path / files[1]["name"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                       # same size, one byte flipped
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{files[1]['name']} does not match its SHA-256"):
        checkpoint.consolidate(path)

    with pytest.raises(CheckpointError, match="metadata.json not found"):
        checkpoint.consolidate(tmp_path / "nothing here")


def _load_into(path, **model_kw):
    model = build("gpt", model_kw=dict(GPT, **model_kw))
    engine = zerolab.initialize(model, stage=1, lr=LR)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)


def _load_with_sgd(path):
    model = build("gpt", model_kw=GPT)
    engine = zerolab.initialize(model, stage=1, lr=LR, optimizer=torch.optim.SGD)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(clusters, saved):
    msg = clusters(2).run(_load_into, str(saved), d_model=16)[0]
    assert "shapes differ" in msg and "tok.weight" in msg
    msg = clusters(2).run(_load_into, str(saved), n_layers=3)[0]
    assert "saved from another model" in msg and "blocks.2." in msg
    assert "holds AdamW state; this engine uses SGD" in clusters(2).run(_load_with_sgd, str(saved))[0]


def _save_that_crashes_before_its_metadata(path, until):
    """Load, train on to step ``until``, then save, failing on rank 0 just before the commit
    (metadata) rename."""
    def load_it(engine):
        engine.load_checkpoint(path)

    def crashing_save(engine):
        write = checkpoint._atomic_write

        def crash_at_commit(file, data):
            if file.name == checkpoint.METADATA:
                raise OSError(28, "No space left on device (injected)")
            write(file, data)
        checkpoint._atomic_write = crash_at_commit
        try:
            engine.save_checkpoint(path, client_state={"data_position": engine.steps})
        finally:
            checkpoint._atomic_write = write            # the fault ends with this save

    return train_engine("gpt", until, stage=2, **LOOP, setup=load_it, finish=crashing_save)


def test_a_crash_during_save_leaves_the_last_good_checkpoint(clusters, ref, tmp_path):
    path = tmp_path / "ckpt"
    clusters(2).run(train, "2", 5, save_at=5, path=str(path))
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(zerolab.RankError, match=r"ranks 0, 1 raised CheckpointError: could not save the "
                                                r"checkpoint .*rank 0: writing metadata.json: OSError: No space"):
        clusters(2).run(_save_that_crashes_before_its_metadata, str(path), 7)  # saved at 5: 2 more steps
    assert sorted(p.name for p in path.iterdir()) == before     # the failed save's shards are gone
    _check([checkpoint.consolidate(path)], ref[5], "after the crash")
    _check(clusters(2).run(train, "2", 10, load=str(path), save_at=10, path=str(path)), ref[10],
           "resumed after the crash")
    assert len(list(path.iterdir())) == len(before)


# -- a failed save: every rank raises the same CheckpointError, keeps its state, leaves no file ------
def _keep_training(path, until, fault=None):
    """On the ranks of a shared cluster: build (first call) or reuse the engine in rank_state, train
    to ``until``, then save into ``path`` with ``fault`` injected on rank 1: 'nospace' (its free-space
    check says 0), 'fsync' (the write fails half way: ENOSPC from fsync), or None."""
    import errno
    import shutil
    state = zerolab.rank_state()
    if "ckpt engine" not in state:
        model = build("gpt", model_kw=GPT)
        state["ckpt engine"] = zerolab.initialize(model, stage=2, lr=LR)
    engine = state["ckpt engine"]
    run(engine, "gpt", until, shards=SHARDS, **DATA)
    saved = {"usage": shutil.disk_usage, "fsync": os.fsync}
    if dist.get_rank() == 1 and fault == "nospace":
        checkpoint.shutil.disk_usage = lambda p: saved["usage"](p)._replace(free=0)
    if dist.get_rank() == 1 and fault == "fsync":
        def fail(fd):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        checkpoint.os.fsync = fail
    try:
        engine.save_checkpoint(path, client_state={"data_position": engine.steps})
    finally:
        checkpoint.shutil.disk_usage, checkpoint.os.fsync = saved["usage"], saved["fsync"]
    return engine.full_state_dict()


def test_a_failed_save_raises_everywhere_keeps_the_ranks_and_leaves_nothing(tmp_path):
    """A path that is a file; no space on one rank (found before writing); a write that fails half
    way on one rank. Each time every rank raises the same CheckpointError naming the rank and the
    cause, the engines live on in rank_state, no file of the failed save is left, and training goes
    on to the same result as a run that never failed (so does a later save into the same folder)."""
    folder, afile = tmp_path / "ckpt", tmp_path / "a file"
    afile.write_text("not a folder")
    straight = reference("gpt", SHARDS, 4, lr=LR, **DATA)
    cluster = zerolab.Cluster(2, timeout=60)
    try:
        with pytest.raises(zerolab.RankError, match=r"ranks 0, 1 raised CheckpointError: could not save the "
                                                    r"checkpoint into .*a file \(rank 0: .*a file exists and "
                                                    r"is not a folder\)"):
            cluster.run(_keep_training, str(afile), 1)
        cluster.run(_keep_training, str(folder), 2)                 # a good checkpoint at step 2
        good = sorted(p.name for p in folder.iterdir())
        for step, fault, cause in ((3, "nospace", "rank 1: not enough space in .*: 0 bytes free"),
                                   (4, "fsync", "rank 1: writing step00000004-.*OSError: No space left")):
            with pytest.raises(zerolab.RankError, match=f"ranks 0, 1 raised CheckpointError: .*{cause}.*"
                                                        f"the training state is intact"):
                cluster.run(_keep_training, str(folder), step, fault)
            assert sorted(p.name for p in folder.iterdir()) == good, f"{fault}: files left behind"
            assert checkpoint.read_metadata(folder)["steps"] == 2
        assert cluster.run(lambda: "ckpt engine" in zerolab.rank_state()) == [True, True]   # same ranks
        results = cluster.run(_keep_training, str(folder), 4)      # saves into the same folder now
    finally:
        cluster.close()
    _check(results, straight, "trained on through three failed saves")
    assert checkpoint.read_metadata(folder)["steps"] == 4 and len(list(folder.iterdir())) == 3


# -- faults: the error names the rank within the timeout; the cluster resumes from the checkpoint --
@pytest.mark.parametrize("kind", ["raise", "kill", "skip"])
def test_fault_is_named_and_training_resumes_from_the_checkpoint(ref, tmp_path, kind):
    path = str(tmp_path / "ckpt")
    cluster = zerolab.Cluster(2, timeout=8)
    try:
        t0 = time.monotonic()
        with pytest.raises(zerolab.RankError) as info:
            cluster.run(train, "3", 10, save_at=5, path=path, fault=(7, 1, kind))
        assert time.monotonic() - t0 < 8 + 15          # the timeout, plus start-up and steps
        message = str(info.value)
        if kind == "raise":
            assert info.value.ranks == [1] and "rank 1 raised RuntimeError: injected failure at step 7" in message
        elif kind == "kill":
            assert info.value.ranks[0] == 1 and message.startswith("rank 1 died (SIGKILL)"), message
        else:                                           # rank 1 returned; rank 0 waits in a collective
            assert isinstance(info.value, zerolab.RankTimeout)
            assert info.value.ranks == [0] and "rank 0 did not finish within 8 s (rank 1 finished)" in message
        assert checkpoint.read_metadata(path)["steps"] == 5
        _check(cluster.run(train, "3", 10, load=path), ref[10], f"resumed after '{kind}'")
    finally:
        cluster.close()
