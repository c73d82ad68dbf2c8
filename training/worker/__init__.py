"""A train worker's side of the run: the loop Ray Train runs and an epoch's bookkeeping (loop.py), its
learner (learner.py), its batches (feed.py) and what it reports (report.py: the records, the checkpoint, the
epoch's line). It reads what the driver hands it (training/spec.py WorkerSpec) and hands back typed records
(training/records.py); nothing of the driver's planning.
"""
