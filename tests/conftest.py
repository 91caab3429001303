import os

# Keep torch from fighting over the 2 CPU cores when several engine processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
