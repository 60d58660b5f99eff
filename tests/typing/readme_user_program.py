"""A user program written from the README: mypy --strict must accept it and see the compiled classes."""

import numpy as np
import recurrent_cache as rc

cache = rc.RecurrentCache(n_layer=2, n_embd_r=6, n_embd_s=8, n_seq_max=4)
batch = rc.Batch(token=[11, 12, 13, 21], pos=[0, 1, 2, 0], seq_id=[0, 0, 0, 1], logits=[0, 0, 1, 1])
st = cache.init_batch(batch, n_ubatch=4)
for ub in st:
    for il in range(cache.n_layer):
        r: np.ndarray = st.r(il)
        r += 1.0
    owners: list[int] = [ids[0] for ids in ub.seq_id]
size: int = cache.size
handle = cache.cell_table
ok: bool = cache.seq_rm(1, -1, -1)
blob: bytes = cache.state_write()
cache.check()
