"""Types of the compiled one-token steps (_scan.pyx): the selective scan and the gated delta rule."""

import numpy as np

def scan_step(state: np.ndarray, decay: np.ndarray, x: np.ndarray, b: np.ndarray, c: np.ndarray,
              out: np.ndarray, y: np.ndarray, round_f32: bool) -> None: ...
def delta_step(state: np.ndarray, decay: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               beta: np.ndarray, out: np.ndarray, y: np.ndarray, round_f32: bool) -> None: ...
