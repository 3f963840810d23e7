"""Plain data across a trust boundary: what a rank running code we must not trust (a graded
submission) may send back to the process that decides, and how that process reads it.

Plain data is ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, dense CPU tensors
(parameters and views are sent as plain copies of their values), ``torch.dtype``, ``torch.Size``,
and lists, tuples and dicts (keys: str, int) of plain data, nested at most :data:`MAX_DEPTH` deep.

:func:`dumps` runs on the rank: it refuses anything else with a message naming the path to the
offending value and its type, so a test author sees at once what to return instead. :func:`loads`
runs in the trusted process: ``torch.load(..., weights_only=True)``, torch's restricted unpickler,
which builds only tensors and containers and never imports or calls anything a message names. So
a reply cannot run code where it is read, whatever the rank sends (a hostile rank can skip
:func:`dumps` and send any bytes; :func:`loads` is the guard, ``dumps`` is the courtesy).
"""
import io
import numbers

MAX_DEPTH = 64
MAX_BYTES = 1 << 30  # one reply; a rank that sends more is cut off (the parent reads no further)
_ATOMS = (type(None), bool, int, float, str, bytes)


class NotPlainData(TypeError):
    """A value that is not plain data was to be sent back across the trust boundary."""


def plain(obj, where="the return value", depth=0):
    """``obj`` as plain data (tensors detached, contiguous and owning their storage, on the CPU),
    or :class:`NotPlainData` naming where the first offending value sits and its type."""
    import torch
    if depth > MAX_DEPTH:
        raise NotPlainData(f"{where} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(obj, _ATOMS) and type(obj) in _ATOMS:
        return obj
    if isinstance(obj, (torch.dtype, torch.Size)):
        return obj
    if isinstance(obj, numbers.Number) and type(obj).__module__ == "numpy":
        return plain(obj.item(), where, depth + 1)  # a NumPy scalar: its Python number
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_meta or (type(obj) not in (torch.Tensor, torch.nn.Parameter)):
            raise NotPlainData(f"{where} is a {type(obj).__name__} ({obj.layout}): send a dense tensor "
                               f"(e.g. .full_tensor() or .to_local() for a DTensor)")
        t = obj.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)  # a view: send its values, not its base
        return t
    if type(obj) in (list, tuple):
        return type(obj)(plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj))
    if type(obj) is dict:
        out = {}
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise NotPlainData(f"{where} has a key of type {type(k).__name__} ({k!r}): keys must be str or int")
            out[k] = plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    raise NotPlainData(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}: return plain data "
                       f"(tensors, numbers, str, bool, None, and lists, tuples and dicts of them)")


def dumps(obj, where="the return value"):
    """Bytes of ``obj`` (checked and converted by :func:`plain`)."""
    import torch
    buf = io.BytesIO()
    torch.save(plain(obj, where), buf)
    return buf.getvalue()


def loads(data):
    """The plain data in ``data``, read without running anything it names (weights_only)."""
    import warnings

    import torch
    with warnings.catch_warnings():  # "Detected pickle protocol 4": torch.save's own protocol
        warnings.simplefilter("ignore")
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
