"""Engine KV tensors as the addresses kvtier registers (``kvtier_register_*_tensors``).

A registered region is, for each (part, layer) of the rank's stage, page 0's address and
one page stride: page ``s`` is the contiguous run of ``page_tokens x heads x head_dim``
elements at ``base + s * stride`` (or, registered with ``runs`` > 1, that many equal runs
``run_stride`` bytes apart, read in order). The order of the bytes inside a page is the
layout's ``kv_order``, part of the page's identity.

Two tensor forms reach it:

* split K and V (:func:`page_views`): per part and layer a ``[pages, page_tokens, heads,
  head_dim]`` tensor (NHD) or the same shape with heads outside tokens in memory (HND);
* packed K|V (:func:`packed_views`): per layer vLLM's 4-D ``[blocks, heads, block_size,
  K dims + V dims]`` view (its ``LBHNC``/``LBNHC``/``BLHNC``/``BLNHC`` layouts), one block
  of one layer being one contiguous run of ``heads x block_size x 2 x head_dim`` elements.
  kvtier's page model has two equal objects for MHA, so the run is registered as two
  halves (the "K" half at the block's address, the "V" half right after it); the halves
  are bytes of the packed block, never read as K or V, and ``kv_order`` ``packed-*``
  keeps such pages apart from split ones. MLA's ``[blocks, 1, block_size, latent]`` is
  one latent run a block.

  vLLM's ``LHBNC``/``BHLNC`` layouts keep heads outside blocks: the same 4-D view, but one
  block of one layer is ``heads`` runs of ``block_size x 2 x head_dim`` elements (one per
  head) a head stride apart. Read in head order those runs are the bytes of the same block
  in ``LBHNC``, so the halves are the first and the last ``heads / 2`` head runs,
  registered as pages of ``heads / 2`` runs at the head stride (``kvtier_register_*_
  tensor_runs``), with ``kv_order`` ``packed-hnd``: the pages are ``LBHNC``'s, byte for
  byte, and are shared with ``LBHNC`` engines. An odd number of heads above one cannot be
  halved into whole head runs and is refused.

Both check the tensors against the client's :class:`~kvtier.client.Layout` and raise
:class:`~kvtier.errors.LayoutError` naming what differs; :func:`register` picks the host or
the CUDA entry by the tensors' device.
"""

from . import _capi
from .errors import LayoutError


def _bad(msg):
    return LayoutError(_capi.ERR_LAYOUT, msg, "layout")


def _check_dtype(layout, where, t):
    if t.element_size() != layout.dtype_bytes:
        raise _bad(f"{where}: {t.dtype} has {t.element_size()} bytes per element; the layout has {layout.dtype_bytes}")
    if layout.dtype is not None:
        from .client import dtype_name

        try:
            name = dtype_name(t.dtype)
        except ValueError:  # a dtype kvtier has no name for
            name = str(t.dtype)
        # fp8 caches are often held as uint8 tensors: the layout's dtype then says which.
        if name != layout.dtype and not (name == "u8" and layout.dtype.startswith("fp8")):
            raise _bad(f"{where}: the tensor holds {t.dtype}, the layout says dtype {layout.dtype}")


def _same_pages(where, s, n, device, first):
    if first[0] is None:
        first[:] = [s, n, device]
    elif [s, n, device] != first:
        raise _bad(f"{where}: {n} pages of stride {s} on {device}, but the first tensor has {first[1]} of stride "
                   f"{first[0]} on {first[2]}")


def page_views(layout, parts):
    """``parts[p][l]`` is part ``p`` (K, V; or the MLA latent), layer ``l`` as a tensor of
    ``[pages, page_tokens, heads, head_dim]`` whose pages may be strided but whose page
    contents are contiguous, in the layout's ``kv_order`` (``nhd``: tokens outside heads;
    ``hnd``: heads outside tokens). Returns ``(addresses, page_stride_bytes, pages,
    device)``."""
    if len(parts) != layout.parts:
        raise _bad(f"{len(parts)} parts given; the layout has {layout.parts} (K and V, or one MLA latent)")
    if layout.kv_order not in ("nhd", "hnd"):
        raise _bad(f"split K and V tensors given; the layout's kv_order is {layout.kv_order}")
    ptrs, first = [], [None, None, None]
    for p, layers in enumerate(parts):
        if len(layers) != layout.layers:
            raise _bad(f"part {p} has {len(layers)} layer tensors; the layout has {layout.layers} layers")
        for l, t in enumerate(layers):
            where = f"part {p} layer {l}"
            if t.dim() != 4 or t.shape[1] != layout.page_tokens or t.shape[3] != layout.head_dim:
                raise _bad(f"{where}: shape {tuple(t.shape)} is not [pages, {layout.page_tokens}, heads, "
                           f"{layout.head_dim}] (page_tokens, heads, head_dim)")
            _check_dtype(layout, where, t)
            n, h, d = t.shape[1], t.shape[2], t.shape[3]
            want = (h * d, d, 1) if layout.kv_order == "nhd" else (d, n * d, 1)
            if t.stride()[1:] != want and not (h == 1 and t.stride()[1] == d and t.stride()[3] == 1):
                raise _bad(f"{where}: strides {t.stride()} are not a contiguous {layout.kv_order} page "
                           f"(want {want} after the page stride)")
            _same_pages(where, t.stride(0) * t.element_size(), t.shape[0], t.device, first)
            ptrs.append(t.data_ptr())
    return ptrs, first[0], first[1], first[2]


def whole_page_views(layout, parts):
    """``parts[p]`` is part ``p`` as one ``[pages, page_tokens, layers, heads, head_dim]``
    tensor whose pages may be strided but whose page contents are contiguous: each page is
    one page-first object. Returns what :func:`page_views` returns, one address per part."""
    if not layout.page_first:
        raise _bad("one tensor per part holds page-first objects; the layout is layer-first (page_first=False)")
    if len(parts) != layout.parts:
        raise _bad(f"{len(parts)} parts given; the layout has {layout.parts} (K and V, or one MLA latent)")
    want = (layout.page_tokens, layout.layers, layout.kv_heads, layout.head_dim)
    ptrs, first = [], [None, None, None]
    for p, t in enumerate(parts):
        where = f"part {p}"
        if t.dim() != 5 or tuple(t.shape[1:]) != want:
            raise _bad(f"{where}: shape {tuple(t.shape)} is not [pages, {', '.join(map(str, want))}]"
                       " (page_tokens, layers, kv_heads, head_dim)")
        _check_dtype(layout, where, t)
        h, d = layout.kv_heads, layout.head_dim
        if t.stride()[1:] != (layout.layers * h * d, h * d, d, 1):
            raise _bad(f"{where}: strides {t.stride()} leave a page non-contiguous")
        _same_pages(where, t.stride(0) * t.element_size(), t.shape[0], t.device, first)
        ptrs.append(t.data_ptr())
    return ptrs, first[0], first[1], first[2]


def packed_order(t):
    """The order of a packed 4-D ``[blocks, heads, tokens, content]`` block's bytes:
    ``"hnd"`` (heads outside tokens, a head's tokens contiguous: a block is one run, or, see
    :func:`head_stride`, one run per head), ``"nhd"`` (tokens outside heads, one run), or
    None when kvtier cannot address it. One head (or one token) is both: ``"hnd"``."""
    _, h, n, c = t.shape
    s = t.stride()
    if s[3] != 1:
        return None
    if (s[2] == c or n == 1) and (s[1] == n * c or h == 1 or head_stride(t) is not None):
        return "hnd"
    if (s[1] == c or h == 1) and (s[2] == h * c or n == 1):
        return "nhd"
    return None


def head_stride(t):
    """The head stride in elements of a packed 4-D view whose heads sit outside its blocks
    (vLLM's ``LHBNC``/``BHLNC``: each head's ``[tokens, content]`` run contiguous, the runs
    of one block not), or None when a block is one run (or the runs are not of that form)."""
    _, h, n, c = t.shape
    s = t.stride()
    if h == 1 or s[3] != 1 or not (s[2] == c or n == 1) or s[1] == n * c:
        return None
    return s[1] if s[1] >= n * c else None


def packed_views(layout, layers, tp_heads, kv_groups=False):
    """``layers[l]`` is vLLM's 4-D view of layer ``l``: ``[blocks, tp_heads, page_tokens,
    2 x head_dim]`` for MHA (K dims then V dims per token and head), ``[blocks, 1,
    page_tokens, latent]`` for MLA. Returns ``(parts, page_stride_bytes, pages, device,
    runs, run_stride_bytes)`` where ``parts`` are the addresses :func:`register_addresses`
    takes (MHA: the K halves, then the V halves) and each page of one is ``runs`` runs
    ``run_stride_bytes`` apart (heads outside blocks; else one run).

    ``kv_groups``: vLLM's K/V-group packing, ``[blocks, 2, page_tokens, tp_heads x
    head_dim]`` (two head slots, K then V, each tokens outside heads): the halves are K and
    V, the layout's ``kv_order`` ``nhd``."""
    if len(layers) != layout.layers:
        raise _bad(f"{len(layers)} layer tensors given; the layout has {layout.layers} layers")
    content = layout.head_dim if layout.mla else 2 * layout.head_dim
    heads = 1 if layout.mla else tp_heads
    order = "hnd" if layout.mla else layout.kv_order.removeprefix("packed-")
    if kv_groups:
        heads, content, order = 2, tp_heads * layout.head_dim, "hnd"
        if layout.mla or layout.kv_order != "nhd":
            raise _bad(f"K and V head slots given; the layout's kv_order is {layout.kv_order} (want nhd)")
    elif not layout.mla and not layout.kv_order.startswith("packed-"):
        raise _bad(f"packed K|V blocks given; the layout's kv_order is {layout.kv_order}")
    first, ks, vs, runs = [None, None, None], [], [], None
    for l, t in enumerate(layers):
        where = f"layer {l}"
        if t.dim() != 4 or tuple(t.shape[1:]) != (heads, layout.page_tokens, content):
            what = "latent" if layout.mla else "heads x head_dim" if kv_groups else "K + V head dims"
            raise _bad(f"{where}: shape {tuple(t.shape)} is not [blocks, {heads}, {layout.page_tokens}, {content}] "
                       f"({'K and V slots' if kv_groups else 'heads of this rank'}, page_tokens, {what})")
        _check_dtype(layout, where, t)
        got = packed_order(t)
        if got != order:
            raise _bad(f"{where}: strides {t.stride()} are " + (f"a packed {got} block" if got else
                       "not one contiguous run a block, nor one run a head") + f"; the layout says {layout.kv_order}"
                       + (" with K and V slots" if kv_groups else ""))
        esz = t.element_size()
        _same_pages(where, t.stride(0) * esz, t.shape[0], t.device, first)
        hs = head_stride(t)
        if hs is not None and heads % 2:
            raise _bad(f"{where}: strides {t.stride()} keep each of {heads} heads in its own run; an odd number of "
                       "heads does not halve into whole head runs (kvtier keeps MHA pages as two equal halves)")
        # The halves: the first heads / 2 head runs, then the last (heads outside blocks);
        # else the first and second half of the block's one run.
        got_runs = (heads // 2, hs * esz) if hs is not None else (1, 0)
        if runs is None:
            runs = got_runs
        elif got_runs != runs:
            raise _bad(f"{where}: {got_runs[0]} run(s) of a page at stride {got_runs[1]}; layer 0 has {runs[0]} at "
                       f"{runs[1]}")
        ks.append(t.data_ptr())
        half = heads // 2 * hs * esz if hs is not None else heads * layout.page_tokens * content * esz // 2
        vs.append(t.data_ptr() + half)
    return (ks if layout.mla else ks + vs), first[0], first[1], first[2], runs[0], runs[1]


def register_addresses(client, ptrs, stride, pages, device, stream=0, runs=1, run_stride=0):
    """Registers the (part, layer) addresses ``ptrs`` (parts outer) as ``client``'s KV
    memory: host memory directly, CUDA memory through the device registration (``stream``
    is the engine's compute stream, 0 for the default one); each page of a tensor is
    ``runs`` runs ``run_stride`` bytes apart. Returns the number of pages."""
    if device.type == "cpu":
        client.register_host_tensors(ptrs, stride, pages, runs, run_stride)
    elif device.type == "cuda":
        client.register_cuda_tensors(device.index or 0, ptrs, stride, pages, stream, runs, run_stride)
    else:
        raise _bad(f"tensors on {device}: kvtier registers host (cpu) or cuda tensors")
    return pages


def register(client, parts, stream=0):
    """Registers ``parts`` (as :func:`page_views` takes them, or one tensor per part as
    :func:`whole_page_views` takes them) as ``client``'s KV memory. Returns the number of
    pages."""
    whole = bool(parts) and all(hasattr(t, "dim") for t in parts)
    ptrs, stride, pages, device = (whole_page_views if whole else page_views)(client.layout, parts)
    return register_addresses(client, ptrs, stride, pages, device, stream)
