import numpy as np

RTOL = 1e-5


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def split_points(length: int, pieces=(1, 3, 7)) -> list[int]:
    """Boundaries of consecutive pieces of the given sizes, the remainder as the last piece."""
    bounds, start = [0], 0
    for size in pieces:
        if start + size < length:
            start += size
            bounds.append(start)
    bounds.append(length)
    return bounds
