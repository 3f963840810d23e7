"""Sharded checkpoints for every stage: save on N ranks, load on M ranks at any stage, or
consolidate into one plain state dict (DeepSpeed's ``zero_to_fp32``) without a process group.
One writer per folder: two jobs saving into the same folder at once would remove each other's files.

    engine.save_checkpoint("ckpt")                  # every rank, between steps
    engine.load_checkpoint("ckpt")                  # any world size, any stage
    state = zerolab.checkpoint.consolidate("ckpt")  # one process: {name: fp32 tensor}
    python -m zerolab.checkpoint ckpt model.pt      # the same, from a shell

**What each rank writes: only what it owns, addressed by parameter.** Under ZeRO a rank owns a
contiguous slice of a flat buffer (:mod:`zerolab.flat`), which may cut parameters in two. A flat
offset means nothing to a run with another world size or stage, so the file stores every owned
element range as (parameter name, first element, last element + 1) with its fp32 master values and
its optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``). Together the N files cover every element
of every parameter exactly once: 12Ψ/N bytes per rank for fp32 Adam (master and two moments),
whatever the stage.
Data parallelism replicates everything, so there rank 0 writes it all. Loading reassembles each
parameter from the ranges, then each rank cuts out what it owns in ITS layout: resharding is free.
(Here every rank reads every file: fine for a course. PyTorch's Distributed Checkpoint reads only
the overlapping ranges, the same idea at scale.)

**Nothing is lost in a crash.** A file is written to a temporary name, flushed to disk and renamed
(atomic on POSIX). Each save uses fresh file names; ``metadata.json``, which lists the files with
their sizes and SHA-256 checksums, is replaced last, again by rename. Until that rename the folder's
metadata still describes the previous, complete checkpoint; files it does not list are removed only
after it. A missing, truncated or altered file is reported by name, never loaded in part.
"""
import datetime
import hashlib
import io
import json
import os
import pathlib
import re
import secrets
import shutil
import sys

import torch
import torch.distributed as dist

from zerolab.flat import unique_trainable

FORMAT = "zerolab-checkpoint"
VERSION = 1
METADATA = "metadata.json"
DEVICE = "device"          # a piece's compute-dtype values while a delayed update is pending
_SHARD_FILE = re.compile(r"^step\d+-[0-9a-f]+-rank\d+-of-\d+\.pt(\.tmp)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, truncated, altered or incompatible files) or
    saved (a destination that is a file, read-only or full: raised on every rank, state intact)."""


# -- what this rank owns, addressed by parameter ---------------------------------------------
def _names(module):
    """{id(param): its first name} and {every state_dict name of a param: that first name}."""
    first, aliases = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        aliases[name] = first[id(p)]
    return first, aliases


def _slots(engine):
    """[(optimizer, master, [(name, lo, hi, offset)], replicated, device)]: each tensor an optimizer
    steps, with the element ranges [lo, hi) of parameter ``name`` it holds, starting at ``offset`` in
    it, whether every rank holds the same (then rank 0 writes it), and the compute-dtype tensor that
    may lag one update behind it (or None). From the engine's public param_slots()."""
    first, _ = _names(engine.module)
    return [(s.optimizer, s.master, [(first[id(p)], lo, hi, off) for p, lo, hi, off in s.ranges], s.replicated,
             s.device) for s in engine.param_slots()]


def _owned(engine):
    """{name: [(lo, hi, {"param": fp32 values, state key: values})]} of what this rank writes; with
    a delayed update pending, also "device": the compute-dtype values the model has, one update behind."""
    pieces = {}
    pending = engine.update_pending
    for optimizer, master, ranges, replicated, device in _slots(engine):
        if replicated and engine.rank != 0:
            continue                            # replicas: rank 0's copy is the checkpoint
        state = optimizer.state.get(master, {})
        flat_state = {k: (v.reshape(-1) if v.dim() else v) for k, v in state.items() if torch.is_tensor(v)}
        m = master.detach().reshape(-1)
        for name, lo, hi, off in ranges:
            n = hi - lo
            # clone: saving a view would write its whole storage (the full flat buffer)
            entry = {"param": m[off:off + n].clone()}   # fp32 master (fp64 for fp64 models)
            for k, v in flat_state.items():
                entry[k] = v.clone() if v.dim() == 0 else v[off:off + n].clone()
            if pending:
                entry[DEVICE] = device.detach().reshape(-1)[off:off + n].clone()
            pieces.setdefault(name, []).append((lo, hi, entry))
    return pieces


def _replicated(engine):
    """Frozen parameters and buffers: identical on every rank, written once by rank 0."""
    trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in engine.module.named_parameters() if id(p) not in trainable}
    buffers = {n: b.detach().clone() for n, b in _persistent_buffers(engine.module).items()}
    return {"frozen": frozen, "buffers": buffers}


# -- writing ---------------------------------------------------------------------------------
def _atomic_write(path, data):
    """Write ``data`` to ``path`` so that a reader sees either the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp.parent, tmp.name)           # no partial file left behind
        raise
    try:                                        # make the rename itself durable (POSIX)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _broadcast_object(obj, group):
    box = [obj]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _persistent_buffers(module):
    """{name: buffer} of the buffers that belong in a state dict (not ``persistent=False`` ones)."""
    keys = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers() if n in keys}


def save(engine, path, *, client_state=None):
    """Save ``engine``'s training state into the folder ``path``. A collective: every rank calls it
    between steps (after ``step()``). ``client_state``: anything picklable to keep with it (data
    loader position, scheduler...), returned by :func:`load`. Returns the metadata dict.

    A save that cannot complete (``path`` is a file, a read-only folder, not enough space, a write
    that fails half way) raises the same :class:`CheckpointError` on EVERY rank, naming each failing
    rank and its cause; the ranks stay alive with their training state untouched (saving never
    changes it), the folder's previous checkpoint stays valid, and the failed save's files are
    removed. The destination is checked on every rank before anything is written (it exists or can
    be created, is a folder, is writable, has room for this rank's file) and the ranks agree on the
    outcome with one small collective."""
    from zerolab import __version__
    engine.quiesce()
    group, rank, n = engine.group, engine.rank, engine.world_size
    folder = pathlib.Path(path)
    payload = {"pieces": _owned(engine), "rank": rank}  # in memory first: its size is known
    if rank == 0:
        payload.update(_replicated(engine), client_state=client_state)
    buf = io.BytesIO()
    cause = None
    try:
        torch.save(payload, buf)
    except Exception as exc:  # noqa: BLE001 - a lock in client_state...: every rank must learn it, not hang
        cause = (f"client_state cannot be saved ({type(exc).__name__}: {exc}): pass plain data (numbers, strings, "
                 f"tensors, lists and dicts of them; a scheduler's state_dict(), not the scheduler)"
                 if rank == 0 and client_state is not None
                 else f"its state cannot be pickled ({type(exc).__name__}: {exc})")
    data = buf.getvalue()
    if rank == 0 and cause is None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            cause = f"creating {folder}: {_why(exc)}"
    # one fresh name per save, agreed by all ranks: the previous checkpoint's files stay untouched
    tag = _broadcast_object(f"step{engine.steps:08d}-{secrets.token_hex(4)}" if rank == 0 else None, group)
    name = f"{tag}-rank{rank:05d}-of-{n:05d}.pt"
    _agree(cause or _check_destination(folder, len(data), name), folder, group, n, "nothing was written")
    try:
        _atomic_write(folder / name, data)
        info = {"name": name, "rank": rank, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    except OSError as exc:
        info = {"error": f"writing {name}: {_why(exc)}"}
    files = [None] * n
    dist.all_gather_object(files, info, group=group)
    failed = [f"rank {r}: {f['error']}" for r, f in enumerate(files) if "error" in f]
    if failed:
        _remove(folder, name)
        raise CheckpointError(_failure(folder, failed, "its partial files were removed"))
    first, aliases = _names(engine.module)
    meta = {
        "format": FORMAT, "version": VERSION, "zerolab": __version__, "torch": torch.__version__,
        "saved": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "stage": engine.stage, "world_size": n, "offload": engine.offload, "steps": engine.steps,
        "loss_scale": None if engine.scaler is None else engine.scaler.state_dict(),
        "param_dtype": None if engine.param_dtype is None else str(engine.param_dtype),
        "optimizer": engine.optimizer_class.__name__,
        "params": {first[id(p)]: {"shape": list(p.shape), "dtype": str(p.dtype)}
                   for p in unique_trainable(engine.module.parameters())},
        "aliases": {a: c for a, c in aliases.items() if a != c},
        "files": files,
        "pending_update": bool(engine.update_pending),
    }
    meta["checksum"] = _meta_checksum(meta)
    committed = None
    if rank == 0:
        try:
            _atomic_write(folder / METADATA, json.dumps(meta, indent=1).encode())   # the commit point
        except OSError as exc:
            committed = f"rank 0: writing {METADATA}: {_why(exc)}"
    committed = _broadcast_object(committed, group)
    if committed is not None:
        _remove(folder, name)
        raise CheckpointError(_failure(folder, [committed], "its files were removed"))
    if rank == 0:
        keep = {f["name"] for f in files}
        for old in folder.iterdir():            # files of earlier (or interrupted) saves
            if _SHARD_FILE.match(old.name) and old.name not in keep:
                old.unlink(missing_ok=True)
    dist.barrier(group=group)                   # returns when the checkpoint is complete
    return meta


def _why(exc):
    """'OSError: No space left on device' (an OSError's text without its [Errno N])."""
    return f"{type(exc).__name__}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"


def _check_destination(folder, need, name):
    """Why this rank cannot write ``need`` bytes as ``name`` into ``folder``, or None."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} exists and is not a folder"
    if not folder.is_dir():
        return f"{folder} does not exist on this rank (rank 0 created it: not a shared file system?)"
    probe = folder / f".{name}.probe"
    try:
        with open(probe, "wb") as f:                # the real test of a writable folder (root
            f.write(b"0")                           # ignores permission bits; a read-only mount
        probe.unlink()                              # does not)
    except OSError as exc:
        _remove(folder, probe.name)
        return f"{folder} is not writable ({_why(exc)})"
    free = shutil.disk_usage(folder).free
    if free < need + (1 << 20):                     # this rank's file + room for the metadata
        return f"not enough space in {folder}: {free} bytes free, {need + (1 << 20)} needed"
    return None


def _agree(cause, folder, group, n, outcome):
    """Every rank learns every rank's ``cause`` (None: fine); all raise the same CheckpointError if any."""
    causes = [None] * n
    dist.all_gather_object(causes, cause, group=group)
    failed = [f"rank {r}: {c}" for r, c in enumerate(causes) if c is not None]
    if failed:
        raise CheckpointError(_failure(folder, failed, outcome))


def _failure(folder, failed, outcome):
    return (f"could not save the checkpoint into {folder} ({'; '.join(failed)}): {outcome}; the folder's "
            f"previous checkpoint (if any) is still valid and the training state is intact: fix the "
            f"destination (or pick another folder) and save again")


def _remove(folder, name):
    """Remove this rank's file of a failed save (and its temporary file)."""
    for file in (folder / name, folder / (name + ".tmp")):
        try:
            file.unlink(missing_ok=True)
        except OSError:
            pass


def _meta_checksum(meta):
    """SHA-256 of the metadata without its "checksum" key, in a canonical JSON form."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- reading ---------------------------------------------------------------------------------
def read_metadata(path):
    """The checkpoint's metadata dict; CheckpointError if ``path`` holds no complete checkpoint."""
    file = pathlib.Path(path) / METADATA
    if not file.exists():
        raise CheckpointError(f"{file} not found: {path} is not a zerolab checkpoint, or its first save "
                              f"did not finish")
    try:
        meta = json.loads(file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{file}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                              f"expected {FORMAT!r} version {VERSION}")
    missing = [k for k in ("stage", "world_size", "steps", "optimizer", "params", "aliases", "files", "checksum")
               if k not in meta]
    if missing:
        raise CheckpointError(f"{file} lacks {missing}: not written by zerolab.checkpoint.save")
    if meta["checksum"] != _meta_checksum(meta):
        raise CheckpointError(f"{file} does not match its own SHA-256 checksum: it was edited by hand or "
                              f"damaged (a changed step count or file list would load the wrong state)")
    return meta


def _read_file(folder, info):
    file = folder / info["name"]
    if not file.exists():
        raise CheckpointError(f"checkpoint file {file} (rank {info['rank']}'s shard) is missing")
    data = file.read_bytes()
    if len(data) != info["bytes"]:
        raise CheckpointError(f"checkpoint file {file} is truncated or overwritten: {len(data)} bytes, "
                              f"metadata says {info['bytes']}")
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(f"checkpoint file {file} does not match its SHA-256 checksum in "
                              f"{METADATA}: the file was altered or is from another save")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _assemble(path):
    """(metadata, {name: {key: full 1-D tensor}}, scalars {name: {key: 0-d tensor}}, rank 0's payload)."""
    folder = pathlib.Path(path)
    meta = read_metadata(folder)
    payloads = [_read_file(folder, info) for info in meta["files"]]
    full, scalars, covered, keys = {}, {}, {}, {}
    for name, spec in meta["params"].items():
        numel = 1
        for d in spec["shape"]:
            numel *= d
        covered[name] = torch.zeros(numel, dtype=torch.int8)
        full[name] = {}
    for payload in payloads:
        for name, pieces in payload["pieces"].items():
            if name not in full:
                raise CheckpointError(f"{path}: rank {payload['rank']}'s file has parameter {name!r}, "
                                      f"which the metadata does not list")
            for lo, hi, entry in pieces:
                if keys.setdefault(name, set(entry)) != set(entry):
                    raise CheckpointError(f"{path}: rank {payload['rank']}'s file has state {sorted(entry)} for "
                                          f"{name!r}, another file {sorted(keys[name])}: not one save")
                covered[name][lo:hi] += 1
                for key, v in entry.items():
                    if v.dim() == 0:
                        scalars.setdefault(name, {})[key] = v
                        continue
                    dst = full[name].setdefault(key, torch.zeros(covered[name].numel(), dtype=v.dtype))
                    dst[lo:hi] = v
    for name, c in covered.items():
        if not bool((c == 1).all()):
            raise CheckpointError(f"{path}: the shards cover parameter {name!r} "
                                  f"{'partly' if bool((c == 0).any()) else 'more than once'}; the files "
                                  f"do not belong to one save")
    return meta, full, scalars, payloads[0]


def consolidate(path):
    """The full state dict of the checkpoint in ``path``: {name: tensor}, loadable into the plain
    model with ``model.load_state_dict`` (tied names included). Trained parameters are their fp32
    masters (fp64 for fp64 models); buffers and frozen parameters are as saved, in the compute
    dtype. Needs no process group (DeepSpeed's zero_to_fp32)."""
    meta, full, _, rank0 = _assemble(path)
    out = {name: full[name]["param"].view(meta["params"][name]["shape"]) for name in meta["params"]}
    out.update(rank0["frozen"])
    out.update({alias: out[canonical] for alias, canonical in meta["aliases"].items()})
    out.update(rank0["buffers"])
    return out


def load(engine, path):
    """Load the checkpoint in ``path`` into ``engine``, whatever world size and stage saved it. A
    collective: every rank calls it between steps. Restores parameters (fp32 masters), optimizer
    state, buffers, frozen parameters and ``engine.steps``; returns the saved ``client_state``.
    Hyperparameters (lr, betas...) stay those ``engine`` was built with."""
    meta, full, scalars, rank0 = _assemble(path)
    _check_compatible(engine, meta, rank0, path)      # before anything is written: all or nothing
    engine.quiesce()
    slots = _slots(engine)
    # saved during a delayed update: resume it (the model's values one update behind the masters)
    # when this engine runs one too; otherwise the pending update is applied (masters everywhere)
    resume_pending = bool(meta.get("pending_update")) and bool(getattr(engine, "delayed_update", False)) \
        and all(device is not None for *_, device in slots)
    with torch.no_grad():
        states = {}                                                  # optimizer -> {index: state}
        for optimizer, master, ranges, _, device in slots:
            m = master.view(-1)
            keysets = [set(full[n]) - {"param", DEVICE} for n, *_ in ranges]
            if any(k != keysets[0] for k in keysets):
                raise CheckpointError(f"{path}: parameters sharing one optimizer tensor have different "
                                      f"optimizer state: {[n for n, *_ in ranges][:5]}")
            keys = keysets[0] if ranges else set()
            state = {k: torch.zeros_like(m) for k in keys}          # padding elements stay zero
            for name, lo, hi, off in ranges:
                m[off:off + hi - lo].copy_(full[name]["param"][lo:hi])
                if resume_pending:
                    device.view(-1)[off:off + hi - lo].copy_(full[name][DEVICE][lo:hi])
                for k in keys:
                    state[k][off:off + hi - lo].copy_(full[name][k][lo:hi])
            index = [id(q) for g in optimizer.param_groups for q in g["params"]].index(id(master))
            states.setdefault(optimizer, {})
            if keys:                                                 # none before the first step
                state.update(scalars.get(ranges[0][0], {}))          # e.g. Adam's step counter
                states[optimizer][index] = {k: v.view_as(master) if v.dim() else v
                                            for k, v in state.items()}
        for optimizer, state in states.items():
            sd = optimizer.state_dict()
            sd["state"] = state              # torch casts it to each master's dtype and device
            optimizer.load_state_dict(sd)
        engine.reload_from_masters(pending=resume_pending)            # compute params = masters
        named = dict(engine.module.named_parameters())
        for name, value in rank0["frozen"].items():
            named[name].copy_(value)
        buffers = _persistent_buffers(engine.module)
        for name, value in rank0["buffers"].items():
            buffers[name].copy_(value)
    engine.steps = meta["steps"]
    if engine.scaler is not None and meta.get("loss_scale"):
        engine.scaler.load_state_dict(meta["loss_scale"])             # the scale goes on where it was
    return rank0["client_state"]


def _check_compatible(engine, meta, rank0, path):
    """CheckpointError unless the checkpoint's parameters, buffers and optimizer are the engine's."""
    first, _ = _names(engine.module)
    mine = {first[id(p)]: list(p.shape) for p in unique_trainable(engine.module.parameters())}
    saved = {name: spec["shape"] for name, spec in meta["params"].items()}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise CheckpointError(f"{path} was saved from another model: missing trainable parameters "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    shapes = [(n, saved[n], mine[n]) for n in mine if mine[n] != saved[n]]
    if shapes:
        raise CheckpointError(f"{path}: shapes differ (name, saved, this model): {shapes[:5]}")
    trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
    here = {n: list(p.shape) for n, p in engine.module.named_parameters() if id(p) not in trainable}
    here.update({n: list(b.shape) for n, b in _persistent_buffers(engine.module).items()})
    there = {n: list(t.shape) for kind in ("frozen", "buffers") for n, t in rank0[kind].items()}
    if here != there:
        diff = sorted(n for n in set(here) | set(there) if here.get(n) != there.get(n))
        raise CheckpointError(f"{path}: frozen parameters or buffers differ from this model's: {diff[:5]}")
    if meta["optimizer"] != engine.optimizer_class.__name__:
        raise CheckpointError(f"{path} holds {meta['optimizer']} state; this engine uses "
                              f"{engine.optimizer_class.__name__}")


def main(argv=None):
    """python -m zerolab.checkpoint CHECKPOINT_DIR OUTPUT.pt: consolidate into one fp32 state dict."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    try:
        state = consolidate(argv[0])
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    torch.save(state, argv[1])
    meta = read_metadata(argv[0])
    print(f"{argv[1]}: {len(state)} tensors, {sum(v.numel() for v in state.values()):,} elements, from "
          f"stage {meta['stage']} on {meta['world_size']} ranks at step {meta['steps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
