"""What the vLLM test scripts share: a tiny Llama config on CPU that vLLM 0.33's own
ModelConfig accepts without weights or a tokenizer, its KV geometry, and vLLM's block
hashing initialised as the engine does it."""

import json
import tempfile
from pathlib import Path

from vllm.config import ModelConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

BS, HEADS, DIM, BLOCKS = 16, 2, 16, 24
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def tiny_model_config():
    """A two-layer Llama ModelConfig from a config.json in a fresh temp dir."""
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * DIM,
        "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "num_hidden_layers": len(LAYERS), "vocab_size": 1000, "max_position_embeddings": 2048,
        "torch_dtype": "float16", "rms_norm_eps": 1e-6,
    }))
    config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0,
                         max_model_len=1024)
    init_none_hash(sha256)
    return config
