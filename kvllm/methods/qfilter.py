"""Q-Filters: keep the keys that project furthest along the direction the queries favour.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression",
2025, arXiv:2503.02812. References read: kvpress 0.5.5,
``kvpress/presses/qfilter_press.py`` (``QFilterPress.score``), and the authors'
NathanGodey/qfilters at cda5c38, ``make_filters.py`` (how the filters are computed).
Per (sequence, layer l, KV head h), with ``f_{l,h}`` the calibration file's filter, in
fp32::

    s_i = -(f_{l,h} . k_i)        for i in the compressible area C (i < C)

and the top-m of ``s``, ``k`` being the post-RoPE keys, as the cache holds them. No
queries are read at selection time: the queries are summarised, once per model, in the
filters.

The filters (:func:`kvllm.hf.calibrate.q_filters`, run by ``kvllm calibrate``), as
``make_filters.py`` computes them: for each query head ``g``, ``v_g`` is the first right
singular vector of its calibration queries ``Q_g`` ``[T, D]`` (not centred); its sign is
chosen so that most queries project positively (``Q_g v_g > 0`` for more than half of
them); and the KV head's filter is the mean over its group of ``-v_g``. The queries are
post-RoPE, as there: its modelling files hand the cache the queries after
``apply_rotary_pos_emb``, and the filters score post-RoPE keys. The minus is the authors'
convention, which kvpress's score undoes, so a key scores high when it points along the
queries' favoured direction, where they give it large logits.

Where we differ, and why:

- *Filters computed here, not downloaded.* kvpress loads ``nthngdy/<model>_qfilt`` from
  the Hugging Face Hub, and has filters only for the models the authors published;
  nothing can be downloaded here, and our models are not among them. ``kvllm calibrate``
  computes them from the model's own queries on generated task texts of the training
  seeds, never the development or test ones; the method reads them from the file named
  by its ``calibration`` parameter. The file's ``q_filters`` tensor ``[L, Hkv, D]`` is
  in the authors' convention, so a published filter tensor would work unchanged.
- *Calibration texts.* The authors run about 20 web texts of 2,048 tokens (fineweb);
  ours are 32 generated tasks (about 1,000 tokens each) of the training seeds, the kind
  of text the shipped model was trained on, prompt and chain of thought: a window's
  keys are a chain of thought's.
- *Every query, not 3,000.* ``make_filters.py`` takes the SVD of 3,000 queries drawn at
  random per layer; the first right singular vector is the top eigenvector of
  ``Q_g^T Q_g``, accumulated here over every calibration query, so there is no draw.
- *Candidates and budget.* kvpress scores every key of the prompt; here only the
  window's compressible area is a candidate, and exactly ``min(m, C)`` keys stay per
  (layer, KV head), as the paged engine needs.
- *fp32.* kvpress casts the filters to the model's dtype; the score here is in fp32.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvllm.checks import fail
from kvllm.methods.base import FIELD, Method, MethodParams, Selection, Window, register
from kvllm.methods.scoring import topk_sorted

#: The calibration file's tensor: ``[L, Hkv, D]`` fp32 filters.
FILTERS = "q_filters"


@dataclass(frozen=True)
class Calibration:
    """A calibration file's content: one method's tensor.

    Attributes
    ----------
    tensor
        ``[L, Hkv, ...]`` fp32, on the CPU (``q_filters``: ``[L, Hkv, D]``).
    metadata
        What ``kvllm calibrate`` recorded: the model, its shape, the calibration texts.
    """

    tensor: Tensor
    metadata: Mapping[str, str]

    def describe(self) -> str:
        """The model the file was written for, for error messages."""
        return self.metadata.get("model", "an unnamed model")


def model_signature(model_config: Any) -> dict[str, str]:
    """What a calibration file records of its model (``kvllm calibrate``) and is checked
    against before it serves (:meth:`QFilter.check_model`), from a transformers config."""
    heads = model_config.num_attention_heads
    return {
        "model_type": str(model_config.model_type),
        "num_layers": str(model_config.num_hidden_layers),
        "num_attention_heads": str(heads),
        "num_kv_heads": str(getattr(model_config, "num_key_value_heads", None) or heads),
        "head_dim": str(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads),
        "hidden_size": str(model_config.hidden_size),
        "vocab_size": str(model_config.vocab_size),
    }


def save_calibration(path: str | Path, tensor: Tensor, metadata: Mapping[str, str], name: str = FILTERS) -> None:
    """Write a method's ``tensor`` ``[L, Hkv, ...]`` (``q_filters`` by default) and ``metadata`` to ``path``."""
    if tensor.dim() != 3:
        raise ValueError(f"{name} must be [L, Hkv, ...], got {tuple(tensor.shape)}")
    save_file({name: tensor.detach().float().cpu().contiguous()}, str(path), metadata=dict(metadata))


def load_calibration(path: str, name: str = FILTERS) -> Calibration:
    """The tensor ``name`` of the calibration file at ``path``, read once per (path,
    modification time, size).

    Raises ``ValueError`` naming ``CompressionConfig.params.calibration`` and what is wrong.
    """
    try:
        stat = os.stat(path)
    except OSError as err:
        fail(f"{FIELD}.calibration", path, f"cannot be read ({err.strerror}): run `kvllm calibrate MODEL --out PATH`")
    # The stat in the key: a file written again under the same name is read again.
    return _read(path, name, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _read(path: str, name: str, mtime_ns: int, size: int) -> Calibration:
    try:
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            tensor = f.get_tensor(name) if name in names else None
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        fail(f"{FIELD}.calibration", path, f"is not a safetensors file ({err})")
    if tensor is None or tensor.dim() != 3 or not tensor.is_floating_point():
        kind = f" (written for {metadata['method']})" if "method" in metadata else ""
        fail(
            f"{FIELD}.calibration",
            path,
            f"holds no [L, Hkv, ...] tensor {name!r}{kind}: not this method's `kvllm calibrate` file",
        )
    return Calibration(tensor.float(), metadata)


def check_signature(path: str, name: str, model_config: Any, dims: tuple[str | None, ...]) -> None:
    """The file at ``path`` must be of this model: every field it recorded of
    :func:`model_signature` (files may predate some fields), and its tensor's leading
    dimensions named in ``dims`` (``None``: not compared), match ``model_config``'s.

    The model's path is not compared: the same weights may be served from anywhere."""
    calibration = load_calibration(path, name)
    expected = model_signature(model_config)
    shape = {k: str(v) for k, v in zip(dims, calibration.tensor.shape, strict=False) if k is not None}
    recorded = {**{k: v for k, v in calibration.metadata.items() if k in expected}, **shape}
    wrong = [f"{k} {v} (this model: {expected[k]})" for k, v in recorded.items() if v != expected[k]]
    if wrong:
        fail(
            f"{FIELD}.calibration",
            path,
            f"was written for another model ({calibration.describe()}): {', '.join(wrong)}; "
            "run `kvllm calibrate MODEL --out PATH` for this one",
        )


@dataclass(frozen=True)
class QFilterParams(MethodParams):
    """Attributes
    ----------
    calibration
        Path of the model's calibration file (``kvllm calibrate MODEL --out PATH``);
        no default: the filters belong to one model.
    """

    calibration: str = ""

    def check(self, window: int, buffer: int) -> None:
        if not isinstance(self.calibration, str) or not self.calibration:
            fail(f"{FIELD}.calibration", self.calibration, "must be the path (a str) of a `kvllm calibrate` file")
        load_calibration(self.calibration)


@register
class QFilter(Method):
    name = "qfilter"
    Params = QFilterParams

    def check_model(self, model_config: Any) -> None:
        """The file must be of this model: its filters' shape and what it recorded of the model."""
        check_signature(self.params.calibration, FILTERS, model_config, ("num_layers", "num_kv_heads", "head_dim"))

    def select(self, window: Window, budget: int) -> Selection:
        path = self.params.calibration
        calibration = load_calibration(path)
        _, layers, hkv, _, d = window.keys.shape
        if tuple(calibration.tensor.shape) != (layers, hkv, d):
            fail(
                f"{FIELD}.calibration",
                path,
                f"holds filters of {list(calibration.tensor.shape)} [layers, KV heads, head dim] "
                f"(for {calibration.describe()}), but this model's windows have [{layers}, {hkv}, {d}]",
            )
        c = window.n_compress
        filters = calibration.tensor.to(window.keys.device)[None, :, :, None, :]  # [1, L, Hkv, 1, D]
        scores = -(filters * window.keys[..., :c, :].float()).sum(dim=-1)
        return Selection(topk_sorted(scores, min(budget, c)))
