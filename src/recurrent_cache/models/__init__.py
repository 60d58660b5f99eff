"""Models that run on the cache (numpy only; writing GGUF files and quantized tensors need ``gguf``).

    from recurrent_cache.models import trained_model
    model = trained_model()                     # the shipped byte-level Mamba
    cache = model.new_cache(n_seq_max=4)
    logits = model.forward(cache.init_batch(rc.Batch(token=model.vocab.encode("def f"), seq_id=[0] * 5)))
"""

from ..errors import ModelError
from .mamba import MambaHParams, MambaLayer, MambaModel, ReferenceRun, load_gguf, random_model, write_gguf
from .sampling import Sampler
from .trained import TRAINED_GGUF, held_out_prompts, trained_model, training_facts
from .vocab import Vocabulary, escape

__all__ = ["MambaHParams", "MambaLayer", "MambaModel", "ModelError", "ReferenceRun", "Sampler",
           "TRAINED_GGUF", "Vocabulary", "escape", "held_out_prompts", "load_gguf", "random_model",
           "trained_model", "training_facts", "write_gguf"]
