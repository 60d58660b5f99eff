"""Models that run on the cache (numpy only; GGUF files need the ``gguf`` package).

    from recurrent_cache.models import random_model
    model = random_model(seed=0)
    cache = model.new_cache(n_seq_max=4)
    logits = model.forward(cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 0, 1], pos=[0, 1, 0])))
"""

from .mamba import (MambaHParams, MambaLayer, MambaModel, ModelError, ReferenceRun, load_gguf,
                    random_model, write_gguf)

__all__ = ["MambaHParams", "MambaLayer", "MambaModel", "ModelError", "ReferenceRun",
           "load_gguf", "random_model", "write_gguf"]
