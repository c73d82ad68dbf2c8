"""A train worker's side of the run: the loop Ray Train runs (loop.py), its learner (learner.py), an
epoch's bookkeeping (meter.py) and its batches (feed.py). It reads what the driver hands it (training/spec.py
WorkerSpec) and hands back typed records (training/records.py); nothing of the driver's planning.
"""
