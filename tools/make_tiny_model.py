"""Write a small random-weight Qwen3 model and a locally trained tokenizer to a folder.

Usage: python tools/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import sys

from kvllm.testing import save_tiny_model

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(save_tiny_model(sys.argv[1], hidden_size=128, layers=4, heads=4, kv_heads=2, head_dim=32))
