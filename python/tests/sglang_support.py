"""What the SGLang test scripts share: a KvtierStorage built by SGLang 0.5.23's own
StorageBackendFactory over SGLang's own MHATokenToKVPoolHost on CPU (as SGLang's storage
unit tests build it), and the page arithmetic over that host pool."""

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import kvtier.sglang

PAGE, HEADS, DIM, LAYERS = 4, 2, 16, 3


def storage(socket, instance, model_name, **extra):
    """A KvtierStorage on the daemon at `socket`, and the host pool registered with it."""
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model_name,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
                      "interface_v1": 1, "socket": socket, "instance": instance, **extra})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert isinstance(backend, kvtier.sglang.KvtierStorage), type(backend)
    device = MHATokenToKVPool(256, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, "layer_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS)
    backend.register_mem_pool_host(host)
    return backend, host


def indices(pages):
    """The host-pool token indices of whole pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def page(host, p):
    """Page `p` of a layer-first host pool: every layer's K and V for its tokens."""
    return host.kv_buffer[:, :, p * PAGE:(p + 1) * PAGE]
