"""Where training memory goes: measured accounting of model states, and the ZeRO formulas.

Measured accounting counts each underlying storage ONCE: tied weights, parameters that are
views into a flat buffer, and gradients that alias bucket buffers would otherwise be counted
twice or more.
"""
import torch

KINDS = ("params", "grads", "optimizer", "master")


def storage_bytes_by_kind(tensors_by_kind):
    """Bytes per kind and device, counting each underlying storage once.

    ``tensors_by_kind``: {kind: iterable of tensors}. When one storage appears under several
    kinds, the first kind (in dict order) gets it. Returns {kind: {device_type: bytes}}.
    A view counts its whole storage (a flat buffer is counted once, at its full size).
    """
    seen, out = set(), {}
    for kind, tensors in tensors_by_kind.items():
        per_device = out.setdefault(kind, {})
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            key = (st.device.type, st.device.index, st.data_ptr())
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            per_device[st.device.type] = per_device.get(st.device.type, 0) + st.nbytes()
    return out
