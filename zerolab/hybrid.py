"""Stage 3 beyond one flat group: HSDP, hpZ and ZeRO++'s quantized collectives (lesson 12).

:class:`HybridEngine` is the stage-3 engine of :func:`zerolab.initialize`; without the options below
it IS :class:`zerolab.zero3.Zero3Engine` (every call goes to it). With them it changes where the
parameters live and which links each collective crosses, on a :class:`zerolab.mesh.Mesh` of
``nodes`` x ``per_node`` ranks (p = per_node devices per node, m = nodes, N = m·p, Ψ parameters):

=================================  ==============================  ===========================================
options                            parameters (K: optimizer bytes)  per unit and step, which link
=================================  ==============================  ===========================================
(none): ZeRO-3                     (4+K)Ψ/N                         all-gather x2 + reduce-scatter over all N
``mesh=(m, p)``: HSDP              (4+K)Ψ/p: sharded in the node,   all-gather x2 + reduce-scatter INSIDE the
                                   replicated across nodes          node; all-reduce of the 1/p gradient shard
                                                                    across nodes (FSDP2's 2-D mesh; MiCS)
``mesh=(m, p), hpz=True``: hpZ     (4+K)Ψ/N + 2Ψ/p (a secondary     forward all-gather over all N; backward's
                                   copy, sharded in the node)       from the secondary copy, inside the node
                                                                    (ZeRO++ Sec. 3.2)
``quantize_weights=True``: qwZ     unchanged                        forward all-gather in int8, block-wise
                                                                    (ZeRO++ Sec. 3.1): 1/2 of bf16's bytes
``quantize_gradients="int4"``:     unchanged                        reduce-scatter as quantized all-to-alls:
qgZ (or "int8")                                                     one hop on a flat group, hierarchical
                                                                    (node, then across nodes) with hpZ
                                                                    (ZeRO++ Sec. 3.3)
=================================  ==============================  ===========================================

HSDP and hpZ are exact (float64: equal to one process); qwZ and qgZ are not: the forward computes on
dequantized weights, the optimizer steps on dequantized gradients (lesson 12 measures both errors
and what they do to training). ZeRO++ (arXiv 2306.10209) is hpZ + qwZ + qgZ together: 3M bytes of
cross-node traffic per step become 0.75M (M = the model's bytes).

How: the engine keeps Zero3Engine's schedule (units, prefetch, hooks) and swaps its four primitives
(:class:`HybridOps`, the ``ops`` of exercise 05) and its gradient-shard hook; HSDP also shards over
the node's group (``mesh.intra``) instead of all ranks. Refused (ValueError, in the one options
path, :meth:`HybridEngine.check_options`): hpZ without a mesh, qgZ with HSDP (its gradient path has
no reduce-scatter over all ranks to replace), a mesh with your own ``ops`` or ``group``.
"""
import torch
import torch.distributed as dist

from zerolab import checkpoint, comm, quantize, zero3
from zerolab.engine import Option, is_flag
from zerolab.flat import unique_trainable
from zerolab.mesh import Mesh, mesh_shape
from zerolab.units import plan_units
from zerolab.zero3 import Zero3Engine

GRADIENT_BITS = {None: None, "int8": 8, "int4": 4}
HYBRID_OPTIONS = ("mesh", "hpz", "quantize_weights", "quantize_gradients")


def _is_mesh(v):
    try:
        return v is None or bool(mesh_shape(v))
    except ValueError:
        return False


def check_quantize_block(module, block, ranks, units, persist_numel):
    """ValueError if ``block`` is larger than the largest shard the engine will quantize (a unit's
    Ψ_u / ranks, padded): a block holds at most one shard, so a larger one only asks for buffers
    that scale with the option (10**9 elements: 4 GB per call). Reads only the model's shapes."""
    trainable = unique_trainable(module.parameters())
    plan = plan_units(module, units, trainable, persist_numel=persist_numel)
    sizes = {name: -(-sum(p.numel() for p in ps) // ranks) for name, _, ps, _, _ in plan}
    name = max(sizes, key=sizes.get)
    if block > sizes[name]:
        raise ValueError(f"quantize_block={block} is larger than the largest shard this engine quantizes: "
                         f"{sizes[name]} elements (unit {name!r} over {ranks} ranks). A block holds at most one "
                         f"shard (one scale per shard at most): give quantize_block an int in [1, {sizes[name]}] "
                         f"(DeepSpeed's blocks hold a few thousand elements; lesson 12's tiny model uses 64)")


class HybridOps:
    """Zero3Engine's four primitives for a hybrid engine: where a unit is gathered from and in which
    format, and how its gradients are reduce-scattered."""

    def __init__(self, engine):
        self.engine = engine

    def gather(self, unit, group=None, async_op=False):
        e = self.engine
        full = unit.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        secondary = e.secondary.get(unit.index)
        if e.hpz and e.phase == "backward" and secondary is not None and e.secondary_fresh[unit.index]:
            # hpZ: backward gathers the node's secondary copy, inside the node (fast links only)
            return comm.all_gather(full, secondary, group=e.mesh.intra, async_op=async_op,
                                   tag=f"{unit.name} hpZ")
        tag = f"{unit.name} prefetch" if async_op else unit.name
        if e.quantize_weights:    # qwZ: int8 codes + one fp32 scale per block (ZeRO++ Sec. 3.1)
            work = quantize.quantized_all_gather(full, unit.shard, group=group, bits=8, block=e.quantize_block,
                                                 async_op=async_op, tag=f"{tag} int8")
        else:
            work = comm.all_gather(full, unit.shard, group=group, async_op=async_op, tag=tag)
        if not e.hpz or unit.resident:           # a resident unit is never gathered again in backward
            return work
        keep = lambda: e.keep_secondary(unit)    # hpZ: keep this node's slice of what forward gathered
        if async_op:
            return comm.Then(work, keep)
        if work is not None:
            work.wait()
        keep()
        return None

    def free(self, unit):
        zero3.free(unit)

    def reduce_scatter_grads(self, unit, grad_full, group=None, impl="torch"):
        e = self.engine
        if e.gradient_bits is None:
            return zero3.reduce_scatter_grads(unit, grad_full, group=group, impl=impl)
        own = unit.flat.shard(grad_full)         # the SUM over ranks lands here, as zero3's would
        if e.mesh is not None:                   # hpZ's layout: all N ranks, two hops (node, nodes)
            quantize.hierarchical_reduce_scatter(own, grad_full, e.mesh, bits=e.gradient_bits,
                                                 block=e.quantize_block, tag=unit.name)
        else:                                    # one flat group: one all-to-all
            quantize.quantized_reduce_scatter(own, grad_full, group=group, bits=e.gradient_bits,
                                              block=e.quantize_block, tag=unit.name)
        return None                              # blocking

    @staticmethod
    def register_pre_backward(output, fn):
        return zero3.register_pre_backward(output, fn)


class HybridEngine(Zero3Engine):
    """Stage 3 with ``mesh`` (HSDP), ``hpz``, ``quantize_weights`` (qwZ), ``quantize_gradients`` (qgZ)
    and ``quantize_block``; see the module docstring. ``engine.mesh`` (a :class:`Mesh` or None)
    says which link each byte crossed: ``engine.mesh.link_bytes(engine.last_step_comm)``."""

    OPTIONS = {"mesh": Option(None, "None, (nodes, devices per node) e.g. (2, 2), or a zerolab.mesh.Mesh", _is_mesh),
               "hpz": Option(False, "True or False (needs mesh): backward gathers a secondary copy inside the node",
                             is_flag),
               "quantize_weights": Option(False, "True (int8, block-wise) or False", is_flag),
               "quantize_gradients": Option(None, "None, 'int8' or 'int4'", lambda v: v in GRADIENT_BITS),
               "quantize_block": Option(quantize.DEFAULT_BLOCK, "a positive int (elements per scale)",
                                        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)}

    @classmethod
    def check_options(cls, options):
        """ValueError naming a combination the engine does not support."""
        mesh, hpz, qg = options.get("mesh"), options.get("hpz"), options.get("quantize_gradients")
        if hpz and mesh is None:
            raise ValueError("hpz=True needs mesh=(nodes, devices per node): hpZ's secondary copy is sharded "
                             "inside a node, so the engine must know which ranks share one")
        if qg is not None and mesh is not None and not hpz:
            raise ValueError(f"quantize_gradients={qg!r} with mesh= and hpz=False (HSDP) is not supported: "
                             f"HSDP reduces gradients inside the node, then all-reduces the shard across "
                             f"nodes; qgZ replaces ZeRO-3's reduce-scatter over ALL ranks. Use hpz=True "
                             f"(ZeRO++'s layout) or no mesh")
        block = options.get("quantize_block", quantize.DEFAULT_BLOCK)
        if block != quantize.DEFAULT_BLOCK and not options.get("quantize_weights") and qg is None:
            raise ValueError(f"quantize_block={block} has no effect: nothing is quantized without "
                             f"quantize_weights=True (qwZ) or quantize_gradients='int8' / 'int4' (qgZ). Pass one "
                             f"of them, or leave quantize_block out")
        used = [k for k in HYBRID_OPTIONS if options.get(k) not in (None, False)]
        if used and options.get("ops") is not None:
            raise ValueError(f"ops= (your own ZeRO-3 primitives) cannot be combined with {used}: those options "
                             f"replace the primitives themselves")

    def __init__(self, module, *, mesh=None, hpz=False, quantize_weights=False, quantize_gradients=None,
                 quantize_block=quantize.DEFAULT_BLOCK, ops=None, group=None, **options):
        if mesh is not None and group is not None:
            raise ValueError("mesh= builds its groups from all ranks (the default group): group= cannot be "
                             "combined with it")
        self.mesh = mesh if isinstance(mesh, Mesh) or mesh is None else Mesh(*mesh)
        self.hpz, self.hsdp = hpz, self.mesh is not None and not hpz
        if quantize_weights or quantize_gradients is not None:      # before the model is touched
            ranks = self.mesh.per_node if self.hsdp else dist.get_world_size(group)
            check_quantize_block(module, quantize_block, ranks, options.get("units"),
                                 options.get("persist_numel", 0))
        self.quantize_weights, self.quantize_block = quantize_weights, quantize_block
        self.gradient_bits = GRADIENT_BITS[quantize_gradients]
        self.hybrid = self.mesh is not None or quantize_weights or quantize_gradients is not None
        self.secondary, self.secondary_fresh = {}, {}     # hpZ: unit index -> this rank's slice
        if self.hsdp:
            group = self.mesh.intra                       # HSDP: shard inside the node only
        super().__init__(module, ops=HybridOps(self) if self.hybrid else ops, group=group, **options)

    def replica_group(self):
        """HSDP shards inside a node (``self.group``) and replicates across nodes: every rank of the
        mesh holds the same model."""
        return None if self.mesh is not None else self.group

    # -- hpZ: the secondary partition (ZeRO++ Sec. 3.2) -------------------------------------------
    def keep_secondary(self, unit):
        """After forward's all-gather of ``unit``: copy this rank's 1/p slice of it (its node's
        device index) into the unit's secondary shard, which backward all-gathers inside the node.
        Allocated once, kept between steps (2Ψ_u/p bytes in bf16): hpZ's memory cost."""
        p, j = self.mesh.per_node, self.mesh.local
        piece = unit.full.numel() // p                # the padded buffer is a multiple of N, so of p
        if unit.index not in self.secondary:
            self.secondary[unit.index] = torch.empty(piece, dtype=unit.full.dtype, device=unit.full.device)
        self.secondary[unit.index].copy_(unit.full[j * piece:(j + 1) * piece])
        self.secondary_fresh[unit.index] = True

    def _stale_secondaries(self):
        for i in self.secondary_fresh:
            self.secondary_fresh[i] = False           # the next forward refreshes them

    # -- HSDP: the gradient shard, averaged across the replicas ----------------------------------
    def _keep_grad_shard(self, i, shard):
        if self.hsdp and self.mesh.nodes > 1:
            # ``shard`` is the node's average (reduce-scatter inside the node / p); the replicas of it
            # on the other nodes hold their nodes' averages: all-reduce them, / m = the global mean
            comm.all_reduce(shard, group=self.mesh.inter, tag=f"{self.units[i].name} across nodes")
            shard.div_(self.mesh.nodes)
        super()._keep_grad_shard(i, shard)

    def _step(self):
        super()._step()
        self._stale_secondaries()

    def reload_from_masters(self, *, pending=False):
        super().reload_from_masters(pending=pending)
        self._stale_secondaries()

    # -- what a rank holds ------------------------------------------------------------------------
    def state_tensors(self):
        st = super().state_tensors()
        st["params"] = st["params"] + list(self.secondary.values())   # hpZ's secondary copy: parameters
        return st

    def padding_bytes(self):
        total = super().padding_bytes()
        for i, sec in self.secondary.items():
            flat = self.units[i].flat
            lo = self.mesh.local * sec.numel()
            total += max(0, lo + sec.numel() - max(lo, flat.numel)) * sec.element_size()
        return total

    def save_checkpoint(self, path, client_state=None):
        """HSDP: node 0's ranks hold one full copy of the sharded state (the other nodes' replicas
        are identical), so they write it; everyone waits for it. Otherwise as every stage."""
        if not self.hsdp:
            return super().save_checkpoint(path, client_state=client_state)
        meta = checkpoint.save(self, path, client_state=client_state) if self.mesh.node == 0 else None
        box = [meta]
        dist.broadcast_object_list(box, src=0)        # the world's rank 0 is node 0's rank 0
        return box[0]
