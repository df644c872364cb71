"""KvLLM proper: Kara inside vLLM (CPU, V1 model runner) as an out-of-tree plugin."""
