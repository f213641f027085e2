"""kvtier_torch: hand an engine's own PyTorch KV tensors to kvtier (no copy, no ownership).

``kvtier_register_cuda_tensors`` (include/kvtier.h) takes, for this rank's PP stage, one
device address per (part, layer), parts outer (all K layers, then all V layers; MLA: the
latent), one page stride in bytes and a page count. These helpers compute them from the
tensors vLLM and SGLang keep, checking that each page's run is contiguous:

- vLLM, per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``:
  :func:`vllm_kv_views` (``kv_first=True``), or ``[num_blocks, 2, ...]`` (``kv_first=False``);
- SGLang ``MHATokenToKVPool``: ``k_buffer[layer]`` and ``v_buffer[layer]``, each
  ``[tokens, heads, head_dim]``, a page being ``page_size`` consecutive tokens:
  :func:`sglang_kv_views`; MLA: ``kv_buffer[layer]`` alone.

torch is imported lazily; this module is documentation and an engine-side helper, not part
of CI. Usage::

    views = vllm_kv_views(kv_caches)               # list of per-layer tensors
    ptrs, stride, pages = tensor_addresses(views)
    client.register_cuda_tensors(torch.cuda.current_device(), ptrs, stride, pages,
                                 stream=torch.cuda.current_stream().cuda_stream)

The tensors must stay allocated (and not be re-allocated by the engine) until the client
is closed or another region is registered.
"""


def vllm_kv_views(kv_caches, kv_first=True):
    """Per-part, per-layer page views ``[pages, block_size, heads, head_dim]`` of vLLM's
    per-layer KV tensors: K views of every layer, then V views."""
    if kv_first:  # [2, blocks, ...]
        ks = [t[0] for t in kv_caches]
        vs = [t[1] for t in kv_caches]
    else:  # [blocks, 2, ...]
        ks = [t[:, 0] for t in kv_caches]
        vs = [t[:, 1] for t in kv_caches]
    return ks + vs


def sglang_kv_views(k_buffer, v_buffer, page_size):
    """Page views ``[pages, page_size, heads, head_dim]`` of SGLang's token buffers
    (``v_buffer=None`` for MLA's single ``kv_buffer``)."""
    def paged(t):
        pages = t.shape[0] // page_size
        return t[: pages * page_size].view(pages, page_size, *t.shape[1:])

    views = [paged(t) for t in k_buffer]
    if v_buffer is not None:
        views += [paged(t) for t in v_buffer]
    return views


def tensor_addresses(views):
    """``(ptrs, page_stride, pages)`` for ``kvtier_register_cuda_tensors``.

    Each view is ``[pages, ...]``: dimension 0 steps from page to page (any stride), the
    rest must be contiguous (one page of one layer is one run of bytes)."""
    if not views:
        raise ValueError("no tensors")
    ptrs, stride, pages = [], None, None
    for i, v in enumerate(views):
        if not v.is_cuda:
            raise ValueError(f"tensor {i} is not on a CUDA device")
        inner = v[0]
        if not inner.is_contiguous():
            raise ValueError(f"tensor {i}: a page is not one contiguous run")
        s = v.stride(0) * v.element_size()
        if s < inner.numel() * v.element_size():
            raise ValueError(f"tensor {i}: pages overlap (stride {s} bytes)")
        if stride is None:
            stride, pages = s, v.shape[0]
        elif s != stride or v.shape[0] != pages:
            raise ValueError(f"tensor {i}: stride {s} / {v.shape[0]} pages differ from tensor 0's "
                             f"{stride} / {pages}")
        ptrs.append(v.data_ptr())
    return ptrs, stride, pages
