"""Types of the compiled one-token selective scan (_scan.pyx)."""

import numpy as np

def scan_step(state: np.ndarray, decay: np.ndarray, x: np.ndarray, b: np.ndarray, c: np.ndarray,
              out: np.ndarray, y: np.ndarray, round_f32: bool) -> None: ...
