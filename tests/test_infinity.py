"""ZeRO-Infinity's optimizer offload to disk (zerolab.infinity, arXiv 2104.07857) against independent
references: the same stage without offload (bit for bit, with the same CPU AdamW kernel), one process
in float64 on the global batch (tests/reference.py), a census of the live tensors (what stays in RAM
is the swap buffers, not the states), lesson 09's checkpoints (saved on 2 ranks at stage 3 with the
states on disk, resumed on 1 rank at stage 1, and the other way round), a step that fails half way
(the disk keeps the old state, the engine goes on as if it never ran), and every bad input."""
import gc
import os
import pathlib

import pytest
import torch
import torch.distributed as dist

import zerolab
from helpers import assert_params
from reference import build, rank_batch, reference, train
from zerolab import checkpoint, memory, models

LR = 1e-3
GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=8)
SHARDS = 4
LOOP = dict(size=1, model_kw=GPT, shards=SHARDS, lr=LR)


def _folder(base):
    path = pathlib.Path(base) / f"rank{dist.get_rank()}"
    path.mkdir(exist_ok=True)
    return str(path)


def _closed(engine):
    state = engine.full_state_dict()
    engine.close()                                          # removes this rank's swap folder
    return state


def _disk_vs_plain(base, every_case):
    """(stage, precision, kernel) -> (plain state, disk state) on this rank; several chunks per shard
    (``every_case``: bf16 and the fused kernel too, else float64 with the for-loop kernel). The
    stage-3 engines are closed explicitly, the others left to the garbage collector."""
    out, path = {}, _folder(base)
    for stage in (1, 2, 3):
        for dtype, pdt in ((torch.float64, None), (torch.float32, torch.bfloat16))[:2 if every_case else 1]:
            for kernel in ({"fused": False}, {"fused": True})[:2 if every_case else 1]:
                common = dict(stage=stage, dtype=dtype, param_dtype=pdt, lr=LR, bucket_bytes=40000, **kernel)
                plain = train("gpt", 3, **common)
                disk = train("gpt", 3, offload="disk", offload_path=path, swap_chunk=5000,
                             buffer_count=2 if stage == 2 else 4, finish=_closed if stage == 3 else None, **common)
                out[stage, str(pdt), kernel["fused"]] = (plain, disk)
    gc.collect()                                            # unreachable engines: their finalizers run
    leftover = os.listdir(path)
    return out, leftover


@pytest.mark.parametrize("world_size", [2, 3])
def test_bit_identical_to_the_same_stage_without_offload(clusters, tmp_path, world_size):
    """Stages 1, 2 (several buckets) and 3, float64 and bf16-mixed, torch's for-loop and fused CPU
    AdamW (on 3 ranks: float64, for-loop), 3 steps, several chunks per shard (and 2 swap buffers at
    stage 2): every parameter bit for bit what the same stage computes with its states in memory. The
    swap folders are gone after close() or garbage collection."""
    for rank, (per_case, leftover) in enumerate(clusters(world_size).run(_disk_vs_plain, str(tmp_path),
                                                                         world_size == 2)):
        assert leftover == [], f"rank {rank}: swap files left behind: {leftover}"
        for (stage, pdt, fused), (plain, disk) in per_case.items():
            assert_params([disk], plain, f"rank {rank} stage {stage} {pdt} fused={fused} N={world_size}",
                          exact=True)


def test_float64_equals_one_process_with_accumulation(clusters, tmp_path):
    """float64, 2 micro-batches per step (no_sync at stage 1, reduce per micro-batch at 2 and 3),
    states on disk: equal to ONE process on the global batch to 1e-10 (tests/reference.py)."""
    expected = reference("gpt", 2, 3, micro=2, lr=LR)
    for stage, no_sync in ((1, True), (2, False), (3, False)):
        states = clusters(2).run(lambda base, stage=stage, no_sync=no_sync: train(
            "gpt", 3, stage=stage, offload="disk", offload_path=_folder(base), swap_chunk=3000, lr=LR,
            micro=2, no_sync=no_sync), str(tmp_path))
        assert_params(states, expected, f"stage {stage} + disk, float64", atol=1e-10, rtol=1e-10)


def _memory(base, offload, stage):
    """RAM census of one rank: bytes of live tensors the engine added (after a step), the largest
    number of bytes live beyond those while a disk step runs (at every chunk), the pool, Ψ/N."""
    gc.collect()
    before = memory.live_tensors()
    model = models.build("gpt", seed=0, dtype=torch.float64)
    kw = {"offload_path": _folder(base), "swap_chunk": 4096, "buffer_count": 3} if offload == "disk" else {}
    engine = zerolab.initialize(model, stage=stage, lr=LR, offload=offload, **kw)
    x, y = models.batch("gpt", seed=dist.get_rank(), batch_size=2, model=model)
    engine.backward(engine(x, y))
    during = []
    if offload == "disk":
        d = engine.disk_optimizers()[0]
        real = d._update

        def censused(k, buf, inv_scale):
            real(k, buf, inv_scale)
            now = memory.live_tensors()
            during.append(sum(b for key, (_, _, b) in now.items() if key not in steady))
        d._update = censused
        gc.collect()
        steady = memory.live_tensors()                  # params, grads, pool: before the step
    engine.step()
    engine.zero_grad()
    del x, y
    gc.collect()
    after = sum(b for key, (_, _, b) in memory.live_tensors().items() if key not in before)
    owned = sum(s.numel() for s in engine.shard_optim.shards) if stage > 1 else engine.shards()[0][0].shard_numel
    pool = engine.disk_report()["pool_bytes"] if offload == "disk" else 0
    report = {k: sum(v.values()) for k, v in engine.memory_report().items()}
    placement = engine.placement()
    if offload == "disk":
        engine.close()
    return {"after": after, "during": max(during, default=0), "pool": pool, "owned": owned, "report": report,
            "placement": placement, "shards": len(engine.shards())}


@pytest.mark.parametrize("stage", [2, 3])
def test_what_stays_in_memory_is_the_pool_not_the_states(clusters, tmp_path, stage):
    """Measured by a census of the live tensors (not the engine's accounting): after a step the disk
    engine holds at least 24 bytes per owned element less than the RAM offload engine (float64 master
    and two moments) give or take the pool, and while its step runs, at no chunk does more than one
    chunk's worth of new memory exist beyond the params, gradients and the pool."""
    rows = [clusters(2).run(_memory, str(tmp_path), off, stage) for off in ("optimizer", "disk")]
    for rank, (ram, disk) in enumerate(zip(*rows)):
        states = 3 * 8 * disk["owned"]                            # fp64 master + exp_avg + exp_avg_sq
        saved = ram["after"] - disk["after"]
        assert saved >= states - disk["pool"] - 65536, (rank, saved, states, disk["pool"])
        assert disk["during"] <= 4096 * 8 + 65536, f"rank {rank}: {disk['during']} new bytes during the step"
        assert disk["report"]["master"] == disk["report"]["optimizer"] == 0
        assert disk["report"]["swap_buffers"] >= disk["pool"]
        padding = disk["shards"] * 3 * 4096 * 8            # each shard's last record is a whole chunk
        assert states <= disk["placement"]["disk"] <= states + padding, "one generation of records on disk"


def _fp16_scaled(base):
    common = dict(stage=2, dtype=torch.float32, param_dtype=torch.float16, loss_scale="dynamic", lr=LR,
                  fused=False, bucket_bytes=40000)
    plain = train("gpt", 3, **common)
    disk = train("gpt", 3, offload="disk", offload_path=_folder(base), swap_chunk=5000,
                 finish=lambda e: (e.full_state_dict(), e.scaler.scale_value, e.close())[:2], **common)
    return plain, disk


def test_fp16_loss_scaling_with_the_states_on_disk(clusters, tmp_path):
    """fp16 with dynamic loss scaling (the gradient unscaled into the chunk workspace, never in place):
    bit-identical to stage 2 in memory."""
    for rank, (plain, (disk, scale)) in enumerate(clusters(2).run(_fp16_scaled, str(tmp_path))):
        assert_params([disk], plain, f"rank {rank} fp16 + loss scale, disk", exact=True)
        assert scale > 1


# -- stage 3: the parameters on disk too ---------------------------------------------------------
def _params_on_disk(base):
    """Stage 3 with the optimizer states AND the parameter shards on disk, float64 and bf16, against
    the same stage in memory; the parameter bytes in RAM between steps; the shards read per step."""
    out = {}
    for dtype, pdt in ((torch.float64, None), (torch.float32, torch.bfloat16)):
        common = dict(stage=3, dtype=dtype, param_dtype=pdt, lr=LR, fused=False)
        plain = train("gpt", 3, **common)

        def finish(engine):
            swap = engine.param_swap
            reads0 = swap.file.bytes_read
            x, y = rank_batch("gpt", 9, dist.get_rank(), dist.get_world_size())
            engine.backward(engine(x, y.clone()))
            engine.zero_grad()                   # a forward and backward without a step
            seen = {"state": engine.full_state_dict(), "report": {k: sum(v.values()) for k, v in engine.memory_report().items()},
                    "resident": [swap.resident(u.index) for u in engine.units], "reads": swap.file.bytes_read - reads0,
                    "param_bytes": sum(swap.nbytes), "placement": engine.placement(),
                    "expected_reads": sum(-(-b // 4096) * 4096 * (1 if u.resident else 2)
                                          for b, u in zip(swap.nbytes, engine.units))}
            engine.close()
            return seen
        disk = train("gpt", 3, offload="disk", offload_path=_folder(base), swap_chunk=4096, offload_params=True,
                     finish=finish, **common)
        out[str(pdt)] = (plain, disk)
    return out


def test_stage3_parameters_on_disk_too(clusters, tmp_path):
    """offload_params=True: bit-identical to stage 3 in memory (float64 and bf16, 2 ranks, 3 steps);
    between steps no parameter shard is in memory (the census of memory_report: 0 bytes of params);
    a forward + backward reads every unit's shard from disk before each of its all-gathers: twice, once
    for the root unit (gathered for the whole step)."""
    for rank, per in enumerate(clusters(2).run(_params_on_disk, str(tmp_path))):
        for pdt, (plain, seen) in per.items():
            want = {k: v for k, v in plain.items()}
            assert_params([seen["state"]], want, f"rank {rank} {pdt} params on disk", exact=True)
            assert seen["report"]["params"] == 0 and not any(seen["resident"]), (rank, pdt, seen["report"])
            assert seen["reads"] == seen["expected_reads"], (rank, pdt, seen["reads"], seen["expected_reads"])
            assert seen["placement"]["disk"] >= seen["param_bytes"]


# -- checkpoints -------------------------------------------------------------------------------------
def _train_ckpt(base, spec, until, *, load=None, save=None, **kw):
    stage, offload = spec
    extra = {"offload_path": _folder(base), "swap_chunk": 2048, "offload_params": stage == 3} \
        if offload == "disk" else {}

    def after(engine, step):
        if save and step + 1 == save[0]:
            engine.save_checkpoint(save[1])
    return train("gpt", until, stage=stage, offload=offload, **LOOP, **extra,
                 setup=(lambda e: e.load_checkpoint(load)) if load else None, after_step=after, **kw)


def test_checkpoints_reshard_with_states_on_disk(clusters, tmp_path):
    """Lesson 09's format: save at step 2 on 2 ranks at stage 3 with the states (and the parameter
    shards) on disk; resume on 1
    rank at stage 1 on disk and on 2 ranks at stage 2 in memory; save from memory and resume on disk.
    Each run lands on one process's float64 AdamW at step 4 (1e-10)."""
    expected = reference("gpt", SHARDS, 4, size=1, model_kw=GPT, lr=LR)
    a = str(tmp_path / "a")
    clusters(2).run(_train_ckpt, str(tmp_path), (3, "disk"), 2, save=(2, a))
    meta = checkpoint.read_metadata(a)
    assert (meta["stage"], meta["world_size"], meta["offload"], meta["steps"]) == (3, 2, "disk", 2)
    assert_params([checkpoint.consolidate(a)], reference("gpt", SHARDS, 2, size=1, model_kw=GPT, lr=LR),
                  "consolidated", atol=1e-10, rtol=1e-10)
    for n, spec in ((1, (1, "disk")), (2, (2, None))):
        got = clusters(n).run(_train_ckpt, str(tmp_path), spec, 4, load=a)
        assert_params(got, expected, f"resumed on {n} ranks at {spec}", atol=1e-10, rtol=1e-10)
    b = str(tmp_path / "b")
    clusters(2).run(_train_ckpt, str(tmp_path), (2, None), 2, save=(2, b))
    got = clusters(2).run(_train_ckpt, str(tmp_path), (3, "disk"), 4, load=b)
    assert_params(got, expected, "saved in memory, resumed on disk", atol=1e-10, rtol=1e-10)


# -- a step that fails half way --------------------------------------------------------------------
def _failing_step(base):
    """Step 1 normal; step 2's third record write raises (a disk error); then step 2 again, and 3."""
    model = build("gpt", model_kw=GPT)
    engine = zerolab.initialize(model, stage=2, lr=LR, offload="disk", offload_path=_folder(base), swap_chunk=500)
    d = engine.disk_optimizers()[0]
    rank, n = dist.get_rank(), dist.get_world_size()

    def data(step):
        return rank_batch("gpt", step, rank, n, shards=SHARDS, size=1, model_kw=GPT)
    seen = {}
    for step in range(3):
        x, y = data(step)
        engine.backward(engine(x, y))
        if step == 1:
            generation = d.store.generation
            before = {k: v.clone() for k, v in engine.full_state_dict().items()}
            real, calls = d.store.write, []

            def failing(k, buf):
                calls.append(k)
                if len(calls) == 3:
                    raise OSError(28, "No space left on device (injected)")
                return real(k, buf)
            d.store.write = failing
            try:
                engine.step()
            except OSError as exc:
                seen["error"] = str(exc)
            d.store.write = real
            seen["generation kept"] = d.store.generation == generation
            after = engine.full_state_dict()
            seen["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
            seen["pool free"] = d.pool.in_use() == 0
        engine.step()                                  # step 2 again (its gradients are still there)
        engine.zero_grad()
    seen["state"] = engine.full_state_dict()
    engine.close()
    seen["leftover"] = os.listdir(_folder(base))
    return seen


def test_a_failed_step_leaves_the_old_state_and_training_goes_on(clusters, tmp_path):
    expected = reference("gpt", SHARDS, 3, size=1, model_kw=GPT, lr=LR)
    for rank, seen in enumerate(clusters(2).run(_failing_step, str(tmp_path))):
        assert "No space left on device (injected)" in seen["error"]
        assert seen["generation kept"] and seen["unchanged"] and seen["pool free"], (rank, seen)
        assert seen["leftover"] == []
        assert_params([seen["state"]], expected, f"rank {rank}: trained on after the failure", atol=1e-10,
                      rtol=1e-10)


# -- bad input ------------------------------------------------------------------------------------
def _refusals(base):
    model = build("gpt", model_kw=GPT)
    found = []
    cases = [dict(stage=2), dict(stage=2, offload_path=str(pathlib.Path(base) / "missing")),
             dict(stage=2, offload_path=str(pathlib.Path(base) / "afile")),
             dict(stage=2, offload_path=base, offload_params=True),
             dict(stage=3, offload_path=base, offload_params=True, swap_chunk=3000),
             dict(stage=2, offload_path=base, buffer_count=1), dict(stage=2, offload_path=base, swap_chunk=0),
             dict(stage=2, offload_path=base, direct_io="yes"), dict(stage=0, offload_path=base),
             dict(stage=2, offload_path=base, optimizer=torch.optim.SGD),
             dict(stage=2, offload_path=base, amsgrad=True)]
    for kw in cases:
        try:
            zerolab.initialize(model, lr=LR, offload="disk", **kw)
            found.append("accepted")
        except ValueError as exc:
            found.append(str(exc))
    engine = zerolab.initialize(model, stage=1, lr=LR, offload="disk", offload_path=base)
    try:
        engine.delayed_update = True
        found.append("accepted")
    except ValueError as exc:
        found.append(str(exc))
    engine.close()
    return found


def test_bad_input_is_refused_by_name(clusters, tmp_path):
    (tmp_path / "afile").write_text("x")
    got = clusters(1).run(_refusals, str(tmp_path))[0]
    expected = ["offload='disk' needs offload_path=<folder on the local disk>",
                "missing' does not exist: create the folder first",
                "afile' exists and is not a folder",
                "offload_params=True needs stage 3 (stage 2 + disk offload keeps every parameter whole",
                "swap_chunk=3000 with offload_params=True: use a multiple of 2048",
                "buffer_count=1 is not valid for stage 2 + disk offload: an int >= 2",
                "swap_chunk=0 is not valid for stage 2 + disk offload: a positive int",
                "direct_io='yes' is not valid for stage 2 + disk offload",
                "offload='disk' needs a sharded optimizer: use stage 1, 2 or 3",
                "SGD is not supported: use torch.optim.Adam or AdamW",
                "amsgrad=True keeps a third per-element state",
                "delayed_update=True is not supported with offload='disk'"]
    for message, want in zip(got, expected):
        assert want in message, (want, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
