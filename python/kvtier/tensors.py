"""Engine KV tensors as the addresses kvtier registers (``kvtier_register_*_tensors``).

A registered region is, for each (part, layer) of the rank's stage, page 0's address and
one page stride: page ``s`` is the contiguous run of ``page_tokens x heads x head_dim``
elements at ``base + s * stride``. :func:`page_views` checks that a set of torch tensors
has exactly that shape against the client's :class:`~kvtier.client.Layout` and raises
:class:`~kvtier.errors.LayoutError` naming what differs; :func:`register` picks the host or
the CUDA entry by the tensors' device.
"""

from . import _capi
from .errors import LayoutError


def _bad(msg):
    return LayoutError(_capi.ERR_LAYOUT, msg, "layout")


def page_views(layout, parts):
    """``parts[p][l]`` is part ``p`` (K, V; or the MLA latent), layer ``l`` as a tensor of
    ``[pages, page_tokens, heads, head_dim]`` whose pages may be strided but whose page
    contents are contiguous. Returns ``(addresses, page_stride_bytes, pages, device)``."""
    if len(parts) != layout.parts:
        raise _bad(f"{len(parts)} parts given; the layout has {layout.parts} (K and V, or one MLA latent)")
    ptrs, stride, pages, device = [], None, None, None
    want = (layout.page_tokens, layout.kv_heads, layout.head_dim)
    for p, layers in enumerate(parts):
        if len(layers) != layout.layers:
            raise _bad(f"part {p} has {len(layers)} layer tensors; the layout has {layout.layers} layers")
        for l, t in enumerate(layers):
            if t.dim() != 4 or tuple(t.shape[1:]) != want:
                raise _bad(f"part {p} layer {l}: shape {tuple(t.shape)} is not [pages, {', '.join(map(str, want))}]"
                           " (page_tokens, kv_heads, head_dim)")
            if t.element_size() != layout.dtype_bytes:
                raise _bad(f"part {p} layer {l}: {t.dtype} has {t.element_size()} bytes per element; "
                           f"the layout has {layout.dtype_bytes}")
            inner = t.stride()[1:]
            if inner != (layout.kv_heads * layout.head_dim, layout.head_dim, 1):
                raise _bad(f"part {p} layer {l}: strides {t.stride()} leave a page's tokens non-contiguous")
            s = t.stride(0) * t.element_size()
            if stride is None:
                stride, pages, device = s, t.shape[0], t.device
            elif (s, t.shape[0], t.device) != (stride, pages, device):
                raise _bad(f"part {p} layer {l}: {t.shape[0]} pages of stride {s} on {t.device}, but the first "
                           f"tensor has {pages} of stride {stride} on {device}")
            ptrs.append(t.data_ptr())
    return ptrs, stride, pages, device


def whole_page_views(layout, parts):
    """``parts[p]`` is part ``p`` as one ``[pages, page_tokens, layers, heads, head_dim]``
    tensor whose pages may be strided but whose page contents are contiguous: each page is
    one page-first object. Returns what :func:`page_views` returns, one address per part."""
    if not layout.page_first:
        raise _bad("one tensor per part holds page-first objects; the layout is layer-first (page_first=False)")
    if len(parts) != layout.parts:
        raise _bad(f"{len(parts)} parts given; the layout has {layout.parts} (K and V, or one MLA latent)")
    want = (layout.page_tokens, layout.layers, layout.kv_heads, layout.head_dim)
    ptrs, stride, pages, device = [], None, None, None
    for p, t in enumerate(parts):
        if t.dim() != 5 or tuple(t.shape[1:]) != want:
            raise _bad(f"part {p}: shape {tuple(t.shape)} is not [pages, {', '.join(map(str, want))}]"
                       " (page_tokens, layers, kv_heads, head_dim)")
        if t.element_size() != layout.dtype_bytes:
            raise _bad(f"part {p}: {t.dtype} has {t.element_size()} bytes per element; "
                       f"the layout has {layout.dtype_bytes}")
        h, d = layout.kv_heads, layout.head_dim
        if t.stride()[1:] != (layout.layers * h * d, h * d, d, 1):
            raise _bad(f"part {p}: strides {t.stride()} leave a page non-contiguous")
        s = t.stride(0) * t.element_size()
        if stride is None:
            stride, pages, device = s, t.shape[0], t.device
        elif (s, t.shape[0], t.device) != (stride, pages, device):
            raise _bad(f"part {p}: {t.shape[0]} pages of stride {s} on {t.device}, but the first "
                       f"tensor has {pages} of stride {stride} on {device}")
        ptrs.append(t.data_ptr())
    return ptrs, stride, pages, device


def register(client, parts, stream=0):
    """Registers ``parts`` (as :func:`page_views` takes them) as ``client``'s KV memory:
    host tensors directly, CUDA tensors through the device registration (``stream`` is the
    engine's compute stream, 0 for the default one); ``parts`` of one tensor per part go
    through :func:`whole_page_views`. Returns the number of pages."""
    whole = bool(parts) and all(hasattr(t, "dim") for t in parts)
    ptrs, stride, pages, device = (whole_page_views if whole else page_views)(client.layout, parts)
    if device.type == "cpu":
        client.register_host_tensors(ptrs, stride, pages)
    elif device.type == "cuda":
        client.register_cuda_tensors(device.index or 0, ptrs, stride, pages, stream)
    else:
        raise _bad(f"tensors on {device}: kvtier registers host (cpu) or cuda tensors")
    return pages
