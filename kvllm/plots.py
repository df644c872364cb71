"""The one way every report writes a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt


def save_figure(fig: Any, path: Path, title: str = "") -> Path:
    """Title (if any), lay out and write ``fig``, then free it."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # "tight" keeps a legend placed outside the axes inside the image.
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
