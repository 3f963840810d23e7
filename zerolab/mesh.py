"""A 2-D mesh of process groups: N ranks as ``nodes`` x ``per_node``, and the two kinds of links.

Real clusters have two networks: inside a node, devices talk over NVLink/NVSwitch (hundreds of GB/s
per GPU); between nodes, over InfiniBand or RoCE (tens of GB/s per GPU). Every system after ZeRO-3
arranges its ranks to match (FSDP2's HSDP on a 2-D ``DeviceMesh``, ZeRO++'s hpZ, MiCS). Ranks are
numbered node-major, as launchers number them (rank r is device r % per_node of node r // per_node);
on a 2 x 2 mesh::

                 intra group (one node, fast links)
    node 0:   rank 0 ---- rank 1
                |           |          inter groups (one device index, across nodes: slow links)
    node 1:   rank 2 ---- rank 3

The groups are torch's :class:`~torch.distributed.device_mesh.DeviceMesh` dimensions ("inter":
ranks with this rank's device index on every node; "intra": this rank's node), so the same mesh can
be handed to FSDP2's ``fully_shard(mesh=...)`` for its HSDP. On a CPU machine the "nodes" are a
labelling of processes: every byte still crosses loopback TCP, and the lessons count, per link, what
WOULD cross each kind of wire (:meth:`Mesh.link_bytes` from the algorithms, and
:meth:`Mesh.measured_link_bytes` from the kernel's per-socket counters).
"""
import torch.distributed as dist

from zerolab import comm
from zerolab.launch import rank_device

LINKS = ("intra", "inter")


def mesh_shape(value):
    """(nodes, per_node) from a :class:`Mesh` or a pair of positive ints; ValueError otherwise."""
    if isinstance(value, Mesh):
        return value.nodes, value.per_node
    if (isinstance(value, tuple) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        return value
    raise ValueError(f"mesh={value!r}: give (nodes, devices per node) as a tuple of two positive ints, "
                     f"e.g. (2, 2), or a zerolab.mesh.Mesh")


class Mesh:
    """``nodes`` x ``per_node`` ranks of the default group (a collective: every rank builds it, in
    the same order as its other groups). Attributes: ``rank``, ``node``, ``local`` (this rank's
    device index in its node), ``intra`` and ``inter`` (its two process groups), ``device_mesh``
    (torch's), ``ports`` (which rank is at the other end of each of this process's sockets, for the
    measured bytes per link)."""

    def __init__(self, nodes, per_node):
        from torch.distributed.device_mesh import init_device_mesh
        nodes, per_node = mesh_shape((nodes, per_node))
        if not dist.is_initialized():
            raise ValueError("Mesh: no process group: build it on the ranks (zerolab.launch / Cluster.run)")
        n = dist.get_world_size()
        if nodes * per_node != n:
            raise ValueError(f"mesh=({nodes}, {per_node}) has {nodes * per_node} ranks, but the world has {n}: "
                             f"nodes x devices per node must equal the number of ranks")
        self.nodes, self.per_node, self.size = nodes, per_node, n
        self.rank = dist.get_rank()
        self.node, self.local = divmod(self.rank, per_node)
        # dim 0 varies the node (the "inter" group: replicas in HSDP), dim 1 the device (the node)
        self.device_mesh = init_device_mesh(rank_device().type, (nodes, per_node), mesh_dim_names=("inter", "intra"))
        self.intra = self.device_mesh.get_group("intra")
        self.inter = self.device_mesh.get_group("inter")
        self.ports = comm.peer_map()          # after the groups exist: gloo connected them already

    def __repr__(self):
        return f"Mesh({self.nodes} nodes x {self.per_node} devices, rank {self.rank} = node {self.node} device {self.local})"

    def node_of(self, rank):
        return rank // self.per_node

    def link(self, a, b):
        """'intra' if global ranks ``a`` and ``b`` share a node, else 'inter'."""
        return "intra" if self.node_of(a) == self.node_of(b) else "inter"

    def split(self, by_peer):
        """{peer rank: bytes} -> {"intra": bytes, "inter": bytes} (and "unknown" for bytes whose peer
        is not known: a socket this mesh did not map)."""
        out = dict.fromkeys(LINKS, 0)
        for peer, b in by_peer.items():
            key = "unknown" if peer is None else self.link(self.rank, peer)
            out[key] = out.get(key, 0) + b
        return out

    def link_bytes(self, log):
        """Bytes this rank sent per link in a :class:`zerolab.comm.CommLog`, under the algorithms
        that ran (each record's ``peers``)."""
        return self.split(log.by_peer())

    def measured_link_bytes(self, log):
        """Bytes the kernel sent on this rank's sockets per link during ``log`` (opened with
        ``comm.log(sockets=True)``), or None where that is not measurable (not gloo, not Linux).
        Close the region after the last collective's bytes have left: end it with a barrier."""
        measured = log.measured_by_peer(self.ports)
        return None if measured is None else self.split(measured)
