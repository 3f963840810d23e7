"""One rank's optimizer states in a file on disk, in chunks, with a crash-safe commit per step.

The states of ``numel`` elements (ZeRO-Infinity's optimizer offload to NVMe, arXiv 2104.07857,
Sec. 5.1; here the fp32 master, Adam's momentum and variance, 12 bytes per parameter) are cut into chunks
of ``chunk_numel`` elements. Chunk i is one RECORD: its fields back to back, each padded so that the
record is a whole number of 4 KiB blocks (``O_DIRECT``'s alignment)::

    record i:  | master[lo:hi] pad | exp_avg[lo:hi] pad | exp_avg_sq[lo:hi] pad |
    file:      | record 0, slot A | record 0, slot B | record 1, slot A | record 1, slot B | ...

**Two slots per record, and a manifest that says which is current.** A step reads every record from
the slot of the committed generation g (slot g % 2) and writes it, updated, into the other slot
(g + 1) % 2, never over the data it read. Only when every write of the step has landed and is
durable (``fdatasync``) is the small manifest replaced, atomically (temporary file, fsync, rename),
saying: generation g + 1. A crash at any point before that rename leaves generation g complete and
untouched; after it, g + 1 is. A later :meth:`SwapStore.open` sees one or the other, whole, and checks
it: each record's CRC-32 is in the manifest. The price is twice the disk space (24 bytes per
parameter for 12 of state) and one sync per step.

DeepSpeed writes its swap files in place instead (one ``<param id>.tensor.swp`` per tensor, rewritten
at offset 0 each step: ``swap_out_tensors`` in ``deepspeed/runtime/swap_tensor/utils.py``): they are
scratch space, valid only while the job runs; a crash means restarting from the last checkpoint
(whose ``offloaded_tensors`` folder is a copy of the swap folder, ``DeepSpeedEngine.save_checkpoint``
in ``deepspeed/runtime/engine.py``). Here the file itself is always a consistent state.

Bad input gets a clear error: a folder that does not exist, is not a folder or is not writable, a
disk too small (the file is allocated in full at creation, ``posix_fallocate``, so no write can run
out of space later), and at :meth:`SwapStore.open` a file that is truncated, belongs to another run
(its run id) or whose records do not match their checksums.
"""
import json
import os
import pathlib
import secrets
import shutil
import zlib

import torch

from zerolab.aio import DiskFile, aligned_empty, atomic_write, round_up

FORMAT = "zerolab-swap"
VERSION = 1
MANIFEST = "manifest.json"
STATES = "states.bin"


class SwapError(ValueError):
    """A swap folder or state file that cannot be used: the message names the file and the fix."""


def check_folder(folder, *, need=0):
    """The reason ``folder`` cannot hold ``need`` more bytes of swap files, or None. It must exist
    (zerolab does not create it: a typo would otherwise put gigabytes somewhere unexpected), be a
    folder, be writable (a probe file: root ignores permission bits, a read-only mount does not) and
    have room."""
    folder = pathlib.Path(folder)
    if not folder.exists():
        return f"offload_path {str(folder)!r} does not exist: create the folder first (on the fast local disk)"
    if not folder.is_dir():
        return f"offload_path {str(folder)!r} exists and is not a folder"
    probe = folder / f".zerolab-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as exc:
        return f"offload_path {str(folder)!r} is not writable ({type(exc).__name__}: {exc.strerror or exc})"
    free = shutil.disk_usage(folder).free
    if free < need:
        return (f"not enough space in offload_path {str(folder)!r}: {free:,} bytes free, {need:,} needed "
                f"(two slots of every record: see zerolab.swap)")
    return None


class SwapStore:
    """A rank's chunked state file in ``folder`` (see the module docstring). Build it with
    :meth:`create` or :meth:`open`, not directly.

    ``chunks``: [(lo, hi)] element ranges of the chunks (any sizes up to ``chunk_numel``); ``fields``:
    the names of a record's tensors, in order; ``dtype``: their dtype. ``generation``: the committed
    generation (0 after :meth:`create`). :meth:`read` / :meth:`write` move one record between the file
    and a buffer (a uint8 tensor of ``record_bytes``, aligned for O_DIRECT: from
    :class:`zerolab.aio.BufferPool`); :meth:`views` cuts a buffer into the record's tensors;
    :meth:`commit` makes a step's writes the current state. Reads and writes of different records may
    run in different threads at once."""

    def __init__(self, folder, file, meta):
        self.folder, self.file, self.meta = pathlib.Path(folder), file, meta
        self.chunks = [tuple(c) for c in meta["chunks"]]
        self.fields = tuple(meta["fields"])
        self.dtype = getattr(torch, meta["dtype"])
        self.chunk_numel = meta["chunk_numel"]
        self.element_size = torch.empty((), dtype=self.dtype).element_size()
        self.field_bytes = round_up(self.chunk_numel * self.element_size)
        self.record_bytes = self.field_bytes * len(self.fields)
        self.generation = meta["generation"]
        self._crc = list(meta["crc"])                 # of the committed generation's records
        self._next_crc = {}                           # of records written for the next generation

    # -- creating and opening ----------------------------------------------------------------
    @classmethod
    def layout(cls, numels, chunk_numel):
        """The chunks of shards of ``numels`` elements each: [(shard, lo, hi)], every chunk inside
        one shard (so a chunk's master values go back to one tensor), at most ``chunk_numel`` long."""
        return [(s, lo, min(lo + chunk_numel, n)) for s, n in enumerate(numels) for lo in range(0, n, chunk_numel)]

    @classmethod
    def file_bytes(cls, n_chunks, chunk_numel, dtype, n_fields):
        esize = torch.empty((), dtype=dtype).element_size()
        return 2 * n_chunks * n_fields * round_up(chunk_numel * esize)

    @classmethod
    def create(cls, folder, *, chunks, chunk_numel, dtype, fields, direct="auto", run=None):
        """A new state file in ``folder`` (which must not hold one), allocated in full, generation 0,
        every record zero until written. ``run``: an id recorded in the manifest (default: random)."""
        if chunk_numel <= 0 or any(not 0 <= hi - lo <= chunk_numel for lo, hi in chunks):
            raise ValueError(f"SwapStore.create: chunks must be at most chunk_numel={chunk_numel} long")
        size = cls.file_bytes(len(chunks), chunk_numel, dtype, len(fields))
        why = check_folder(folder, need=size + (1 << 20))
        if why:
            raise SwapError(why)
        folder = pathlib.Path(folder)
        if (folder / STATES).exists() or (folder / MANIFEST).exists():
            raise SwapError(f"{folder} already holds a swap state file: use another folder, or SwapStore.open it")
        try:
            file = DiskFile(folder / STATES, direct=direct, create=True, size=size)
        except OSError as exc:
            for name in (STATES, MANIFEST):
                (folder / name).unlink(missing_ok=True)
            raise SwapError(f"could not allocate the {size:,}-byte swap file in {folder} "
                            f"({type(exc).__name__}: {exc.strerror or exc}): free space, or choose another "
                            f"offload_path") from None
        meta = {"format": FORMAT, "version": VERSION, "run": run or secrets.token_hex(8), "generation": 0,
                "chunks": [list(c) for c in chunks], "chunk_numel": chunk_numel,
                "dtype": str(dtype).replace("torch.", ""), "fields": list(fields), "bytes": size,
                "crc": []}
        store = cls(folder, file, meta)
        store._crc = [zlib.crc32(bytes(store.record_bytes))] * len(chunks)    # allocated: all zeros
        store.meta["crc"] = list(store._crc)
        atomic_write(folder / MANIFEST, json.dumps(store.meta).encode())
        return store

    @classmethod
    def open(cls, folder, *, run=None, direct="auto", verify=True):
        """The state file in ``folder`` at its committed generation. SwapError if the manifest is
        missing or not zerolab's, ``run`` is given and differs (another run's file), the file is shorter
        than the manifest says (truncated), or (``verify``) a record's CRC-32 does not match."""
        folder = pathlib.Path(folder)
        mfile = folder / MANIFEST
        try:
            meta = json.loads(mfile.read_text())
        except FileNotFoundError:
            raise SwapError(f"{mfile} not found: {folder} holds no swap state") from None
        except ValueError as exc:
            raise SwapError(f"{mfile} is not valid JSON ({exc})") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise SwapError(f"{mfile}: not a zerolab swap manifest (format {meta.get('format')!r})")
        if run is not None and meta["run"] != run:
            raise SwapError(f"{folder} holds the swap state of run {meta['run']}, not of this run ({run}): "
                            f"another job's file; use a folder of your own")
        path = folder / STATES
        if not path.exists():
            raise SwapError(f"{path} is missing")
        if path.stat().st_size < meta["bytes"]:
            raise SwapError(f"{path} is truncated: {path.stat().st_size:,} bytes, the manifest says "
                            f"{meta['bytes']:,}")
        store = cls(folder, DiskFile(path, direct=direct), meta)
        if verify:
            store.verify()
        return store

    # -- records -------------------------------------------------------------------------------
    def offset(self, i, generation):
        """Byte offset of record i's slot for ``generation`` (slot generation % 2)."""
        return (2 * i + generation % 2) * self.record_bytes

    def views(self, buf, i):
        """{field: tensor} of record i laid out in ``buf``: (hi - lo) elements each, views, no copy."""
        lo, hi = self.chunks[i]
        n = hi - lo
        out = {}
        for k, name in enumerate(self.fields):
            part = buf[k * self.field_bytes:k * self.field_bytes + n * self.element_size]
            out[name] = part.view(self.dtype)
        return out

    def read(self, i, buf):
        """Record i of the committed generation into ``buf`` (``record_bytes`` uint8)."""
        self.file.read(buf[:self.record_bytes], self.offset(i, self.generation))

    def write(self, i, buf):
        """Record i from ``buf`` into the NEXT generation's slot (never the committed one: a crash in
        the middle of this write leaves the committed state whole). Not current until :meth:`commit`."""
        data = buf[:self.record_bytes]
        crc = zlib.crc32(data.numpy())                  # releases the GIL on large buffers
        self.file.write(data, self.offset(i, self.generation + 1))
        self._next_crc[i] = crc

    def commit(self):
        """Make the records written since the last commit the current state: sync the file, then
        replace the manifest atomically. Every record must have been written (else ValueError: a
        generation with some records missing would read the slot of two steps ago)."""
        missing = [i for i in range(len(self.chunks)) if i not in self._next_crc]
        if missing:
            raise ValueError(f"SwapStore.commit: records {missing[:8]} were not written for generation "
                             f"{self.generation + 1}: every record of a step must be written before it commits")
        self.file.sync()                                # the data first: durable before the manifest says so
        crc = [self._next_crc[i] for i in range(len(self.chunks))]
        meta = dict(self.meta, generation=self.generation + 1, crc=crc)
        atomic_write(self.folder / MANIFEST, json.dumps(meta).encode())    # the commit point
        self.meta, self.generation, self._crc, self._next_crc = meta, self.generation + 1, crc, {}

    def abandon(self):
        """Forget the records written for the next generation (a step that failed): the committed
        state stays current; those slots will be written again."""
        self._next_crc = {}

    def verify(self, buf=None):
        """Check every record of the committed generation against its CRC-32 (SwapError naming the
        first that differs)."""
        buf = aligned_empty(self.record_bytes) if buf is None else buf
        for i in range(len(self.chunks)):
            self.read(i, buf)
            if zlib.crc32(buf[:self.record_bytes].numpy()) != self._crc[i]:
                raise SwapError(f"{self.file.path}: record {i} of generation {self.generation} does not match "
                                f"its checksum: the file was altered, or is not this manifest's")

    @property
    def state_bytes(self):
        """Bytes of one generation's records (what the state occupies; the file holds two)."""
        return len(self.chunks) * self.record_bytes

    def close(self, *, remove=False):
        """Close the file; ``remove``: delete the state file and manifest (the folder stays)."""
        self.file.close()
        if remove:
            for name in (STATES, MANIFEST, MANIFEST + ".tmp"):
                (self.folder / name).unlink(missing_ok=True)

