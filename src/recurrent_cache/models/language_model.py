"""What every language model of the package shares, recurrent or hybrid: the vocabulary, the
embedding, the output head, and the run of a batch state's ubatches.

``RecurrentModel`` (``recurrent.py``: Mamba-1, Mamba-2 on a ``RecurrentCache``) and ``HybridModel``
(``hybrid_model.py``: attention beside recurrent layers on a ``HybridCache``) subclass it; each
supplies ``new_cache`` and ``forward_ubatch``.  Everything a caller of a model uses —
``new_cache``, ``forward``, ``vocab``, ``hparams.n_vocab`` — is here, so code that serves models
(the CLI, ``generation``) takes a ``LanguageModel`` and runs either kind unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal, Protocol

import numpy as np

from ..errors import ModelError
from ..memory_state import MemoryStatus
from ..storage import Storage
from ._arrays import NUMPY, Array, Backend, ModelWeights
from ._host import host_views
from ._ssm import linear, product_weight, rms_norm
from .vocab import Vocabulary

__all__ = ["LanguageModel", "LanguageShape", "backend_of", "checked_tensor"]


class LanguageShape(Protocol):
    """The sizes every model's hyper-parameters provide."""

    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def rms_eps(self) -> float: ...
    def describe(self) -> str: ...


def checked_tensor(array: Any, shape: tuple[int, ...], name: str, dtype: np.dtype[Any] | type,
                   product: bool = False) -> np.ndarray:
    """``array`` as a C-contiguous ``dtype`` array (``product``: a weight of ``_ssm.linear``, in its layout:
    ``_ssm.product_weight``), or ``ModelError`` naming ``name``: wrong shape, not numbers, NaN or inf."""
    array = np.asarray(array)
    if array.shape != shape:
        raise ModelError(f"tensor {name} has shape {array.shape}, expected {shape}")
    if array.dtype.kind not in "fiu":
        raise ModelError(f"tensor {name} holds {array.dtype}, not numbers")
    with np.errstate(all="ignore"):  # an overflow to inf is reported just below
        converted = np.ascontiguousarray(array, dtype=dtype)
    if not np.isfinite(converted).all():
        # NaN or inf weights would make every logit NaN: refuse them with the tensor's name
        raise ModelError(f"tensor {name} holds {np.size(converted) - np.isfinite(converted).sum()} "
                         f"values that are NaN or infinite (as {np.dtype(dtype).name})")
    return product_weight(converted) if product else converted


class LanguageModel(ABC):
    """A language model over one of the package's caches: weights, the embedding and head, the run of a batch.

    ``output=None`` ties the output projection to ``token_embd`` (as llama.cpp
    does when a GGUF file has no ``output.weight``).  Every weight is stored
    in ``dtype``, the type the forward pass computes in (float32 or float64).
    """

    hparams: LanguageShape
    layers: list[Any]

    def __init__(self, hparams: LanguageShape, token_embd: Any, output_norm: Any, output: Any = None,
                 dtype: Any = np.float64, vocab: Vocabulary | None = None) -> None:
        p = self.hparams = hparams
        if vocab is None and p.n_vocab == 256:
            vocab = Vocabulary.of_bytes()
        if vocab is not None and len(vocab) > p.n_vocab:
            raise ModelError(f"a vocabulary of {len(vocab)} tokens for a model of n_vocab = {p.n_vocab}")
        if vocab is not None and len(vocab) < p.n_vocab:  # converters pad n_vocab: padding decodes to nothing
            vocab = vocab.padded(p.n_vocab)
        # token ids <-> bytes; None when the model has no vocabulary (token ids only)
        self.vocab = vocab
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ModelError(f"a model computes in float32 or float64, not {self.dtype}")
        self.token_embd = checked_tensor(token_embd, (p.n_vocab, p.n_embd), "token_embd.weight", self.dtype)
        self.output_norm = checked_tensor(output_norm, (p.n_embd,), "output_norm.weight", self.dtype)
        # a tied output keeps token_embd's rows, which the embedding gathers; an own one is in linear's layout
        self.output = (self.token_embd if output is None
                       else checked_tensor(output, (p.n_vocab, p.n_embd), "output.weight", self.dtype, product=True))

    @property
    def tied(self) -> bool:
        """True when the output projection is ``token_embd`` (no ``output.weight``)."""
        return self.output is self.token_embd

    @abstractmethod
    def new_cache(self, n_seq_max: int = 1, *, dtype: str = "f32", n_rollback: int = 0,
                  engine: Literal["compiled", "reference"] | None = None, storage: str | Storage = "numpy",
                  device: Any = None) -> Any:
        """A cache shaped for this model (``RecurrentCache`` or ``HybridCache``) for ``n_seq_max`` sequences,
        recurrent states stored as ``dtype``, ``n_rollback`` past states per sequence for speculative decoding,
        on ``storage`` / ``device`` (where ``forward`` then runs)."""

    def forward(self, st: Any, *, native: bool = False) -> Any:
        """Run every ubatch of ``st`` (from ``cache.init_batch``), applying each in turn.

        Returns the logits of the output tokens, shape ``[n_outputs, n_vocab]``:
        row ``i`` belongs to batch index ``st.out_ids[i]``.  Where the cache keeps
        its states decides where the model runs: numpy rows, numpy and a numpy
        array; torch rows, torch on their device and a torch tensor on that device,
        in the model's dtype.  Torch rows in host memory (the CPU; float32 or
        float16) are computed on by numpy over the same memory — the faster on a
        CPU, bit for bit what a numpy cache gives — unless ``native`` asks for torch's
        own ops (``_host.py``); the logits are a torch tensor either way.
        """
        if st.status != MemoryStatus.SUCCESS:
            raise ModelError(f"cannot run a batch whose init_batch status is {st.status.name}")
        logits = [self._ubatch_logits(st, native) for _ in st]
        if not logits:
            return np.zeros((0, self.hparams.n_vocab), self.dtype)
        return logits[0] if len(logits) == 1 else _namespace_of(logits[0]).concat(logits)

    def _ubatch_logits(self, st: Any, native: bool) -> Any:
        """``forward_ubatch`` of the applied ubatch, through numpy views of torch CPU rows unless ``native``."""
        views = None if native else host_views(st, self.state_samples(st))
        if views is None:
            return self.forward_ubatch(st)
        return views.tensor(self.forward_ubatch(views))

    @abstractmethod
    def state_samples(self, st: Any) -> list[Any]:
        """One state tensor of each kind ``st`` (with its ubatch applied) holds for this model — r and s rows,
        K and V rows — whose library, device and dtypes decide where ``forward`` computes."""

    @abstractmethod
    def reference_run(self, dtype: str = "f32") -> Any:
        """One sequence run alone, token by token from a zero state, with its states stored as ``dtype``:
        what every batched run must equal (an object with ``feed(tokens) -> logits [len, n_vocab]``
        and ``copy()``)."""

    @abstractmethod
    def forward_ubatch(self, st: Any) -> Any:
        """Run the ubatch that ``st`` has just applied; the logits of its output tokens in ubatch order."""

    # -- input and output ------------------------------------------------------------------

    def embedded(self, backend: Backend, weights: ModelWeights, device: Any, tokens: np.ndarray | None,
                 embd: np.ndarray | None) -> Array:
        """The input rows on ``backend``: ``token_embd`` of ``tokens`` (ids checked), or ``embd`` itself (a copy)
        when tokens is None."""
        if tokens is None:
            return backend.from_host(self.checked_embd(embd).astype(self.dtype), device)
        ids = backend.from_host(self.checked_tokens(tokens).astype(np.int64).reshape(-1), device)
        return backend.xp.take(weights.token_embd, ids, axis=0)

    def checked_tokens(self, tokens: Any) -> np.ndarray:
        """``tokens`` as an array, or ``ModelError`` naming the first id outside the vocabulary."""
        ids = np.asarray(tokens)
        bad = (ids < 0) | (ids >= self.hparams.n_vocab)
        if bad.any():
            raise ModelError(f"token id {int(ids[bad][0])} is outside the vocabulary [0, {self.hparams.n_vocab})")
        return ids

    def checked_embd(self, embd: np.ndarray | None) -> np.ndarray:
        """Embedding input ``[n_tokens, n_embd]`` itself, or ``ModelError`` naming its shape."""
        if embd is None or embd.ndim != 2 or embd.shape[1] != self.hparams.n_embd:
            raise ModelError(f"embedding input of shape {None if embd is None else embd.shape}; "
                             f"this model has n_embd {self.hparams.n_embd}")
        return embd

    def head(self, xp: Any, weights: ModelWeights, x: Array) -> Array:
        """``output @ (rms_norm(x) * output_norm)`` for rows ``x`` [..., n_embd]."""
        return linear(rms_norm(xp, x, self.hparams.rms_eps) * weights.output_norm, weights.output)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """``head`` of numpy rows ``x`` [..., n_embd]."""
        result: np.ndarray = self.head(np, NUMPY.weights(self), x)
        return result


def backend_of(rows: Any) -> tuple[Backend, Any]:
    """The backend that computes on state rows like ``rows``, and their device."""
    if isinstance(rows, np.ndarray):
        return NUMPY, None
    from .torch_forward import TORCH   # rows of another library: torch (the only other storage)

    return TORCH, TORCH.device_of(rows)


def _namespace_of(array: Any) -> Any:
    return NUMPY.xp if isinstance(array, np.ndarray) else backend_of(array)[0].xp
