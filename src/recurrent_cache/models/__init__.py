"""Models that run on the cache, in numpy (torch too, where the cache keeps its states in torch: the ``torch``
extra); writing GGUF files and quantized tensors need ``gguf``.

    from recurrent_cache.models import trained_model
    model = trained_model()                     # the shipped byte-level Mamba
    cache = model.new_cache(n_seq_max=4)
    logits = model.forward(cache.init_batch(rc.Batch(token=model.vocab.encode("def f"), seq_id=[0] * 5)))

Architectures: Mamba-1 (``MambaModel``) and Mamba-2 (``Mamba2Model``), from
GGUF files (``load_gguf``) or Hugging Face checkpoint directories
(``load_hf``; ``load_model`` takes either).  Each family's module registers
itself (``_registry``); importing it here is what makes it loadable.
"""

from .gguf_io import load_gguf, recurrent_layers, write_gguf
from .hf import convert_hf_to_gguf, load_hf, load_model
from .mamba import MambaHParams, MambaLayer, MambaModel, random_model
from .mamba2 import Mamba2HParams, Mamba2Layer, Mamba2Model, random_mamba2_model
from .hybrid_model import HybridModel
from .jamba import JambaHParams, JambaModel, random_jamba_model
from .lfm2 import Lfm2HParams, Lfm2Model, random_lfm2_model
from .bamba import GraniteHybridHParams, GraniteHybridModel
from .falcon_h1 import FalconH1HParams, FalconH1Model, random_falcon_h1_model
from .language_model import LanguageModel
from .qwen3_next import Qwen3NextHParams, Qwen3NextModel, random_qwen3_next_model
from .nemotron_h import NemotronHHParams, NemotronHModel, random_nemotron_h_model
from ..errors import ModelError
from .recurrent import RecurrentModel, ReferenceRun
from ._ssm import get_num_threads, set_num_threads
from .sampling import Sampler
from .trained import TRAINED_GGUF, held_out_prompts, trained_model, training_facts
from .vocab import Vocabulary, escape

__all__ = ["FalconH1HParams", "FalconH1Model", "GraniteHybridHParams", "GraniteHybridModel", "HybridModel",
           "JambaHParams", "JambaModel", "LanguageModel", "Lfm2HParams", "Lfm2Model", "Mamba2HParams", "Mamba2Layer",
           "Mamba2Model", "MambaHParams", "MambaLayer", "MambaModel", "ModelError", "NemotronHHParams",
           "NemotronHModel", "Qwen3NextHParams", "Qwen3NextModel", "RecurrentModel", "ReferenceRun", "Sampler",
           "TRAINED_GGUF", "Vocabulary", "convert_hf_to_gguf", "escape", "get_num_threads", "held_out_prompts",
           "load_gguf", "load_hf", "load_model", "random_falcon_h1_model", "random_jamba_model", "random_lfm2_model",
           "random_mamba2_model", "random_model", "random_nemotron_h_model", "random_qwen3_next_model",
           "recurrent_layers", "set_num_threads", "trained_model", "training_facts", "write_gguf"]
