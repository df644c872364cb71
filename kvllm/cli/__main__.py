"""``python -m kvllm.cli``: the same command as the ``kvllm`` script."""

from kvllm.cli import app

app()
